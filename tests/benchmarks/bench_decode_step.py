"""Where one decode step of the static decoder goes, against the memory-bandwidth floor (issue #17).

    python tests/benchmarks/bench_decode_step.py [--model DIR] [--dtype auto] [--quantized-linear kernel] \
        [--threads 2] [--compile off|on] [--steps 100]

Loads the checkpoint as the worker does, runs one row (55-token prompt) through ``StaticDecoder.step`` in
this thread, and prints: the step's median time; a ``torch.profiler`` split of 20 steps into the matrix
products (by op and weight shape) and everything else; the bytes of weights a step reads; the read
bandwidth of this machine (a ``sum`` over buffers larger than any cache) and the floor those two give.
Printed only (the worker's figures go to ``results/cpu.csv`` through ``bench_cpu.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from cpu_common import cpu_description  # noqa: E402

from squeezeserve.service.models.loader import load_model  # noqa: E402
from squeezeserve.service.worker.local.decoder import StaticDecoder  # noqa: E402

MATMULS = ("mm", "linear", "int8pack", "int4pack", "linear_dynamic_fp16", "_linear_pointwise", "fbgemm")


def read_bandwidth(megabytes: int = 256, repeats: int = 10) -> float:
    """GB/s of a ``sum`` over a float32 buffer of ``megabytes`` (median of ``repeats``)."""
    x = torch.ones(megabytes * 2**20 // 4)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return megabytes * 2**20 / statistics.median(times) / 1e9


def weight_bytes(decoder: StaticDecoder) -> int:
    """Bytes of projection weights (and their scales) one step reads: every layer's and the lm_head's."""
    total = 0
    for linear in [p for layer in decoder.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [
        decoder.lm_head
    ]:
        if getattr(linear, "fp16", None) is not None:
            total += linear.weight.numel() * 2  # FBGEMM keeps it as fp16
            continue
        for name in ("weight", "q", "scale", "packed", "scale_zero"):
            t = getattr(linear, name, None)
            if not isinstance(t, torch.Tensor) or (name == "packed" and hasattr(linear, "weight")):
                continue  # oneDNN's reordered copy replaces the weight, it is not read beside it
            # int4's scales and zeros are read cast to the activations' dtype
            size = decoder.embed.element_size() if name == "scale_zero" else t.element_size()
            total += t.numel() * size
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    home = Path(os.environ.get("SQUEEZESERVE_HOME", Path.home() / ".cache" / "squeezeserve"))
    parser.add_argument("--model", default=str(home / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantized-linear", default="kernel")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--compile", choices=["off", "on"], default="off")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=args.dtype, quantized_linear=args.quantized_linear)
    decoder = StaticDecoder(loaded.model, 16, compile=args.compile == "on")
    compile_s = decoder.warm_up()
    cpu, flags = cpu_description()
    print(f"{cpu} [{flags}], {args.threads} threads, load {os.getloadavg()[0]:.2f}; {args.model} "
          f"{loaded.dtype}, compile={args.compile} ({compile_s:.0f} s)")  # fmt: skip
    with torch.inference_mode():
        decoder.prefill(list(range(100, 155)), False)
        decoder.join(1)
        n, times = 55, []
        for _ in range(args.steps + 10):
            start = time.perf_counter()
            decoder.step([5], [n])
            times.append(time.perf_counter() - start)
            n += 1
        step = statistics.median(times[10:])
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(20):
                decoder.step([5], [n])
                n += 1
    print(f"step: median {step * 1e3:.2f} ms ({1 / step:.1f} tok/s), load {os.getloadavg()[0]:.2f}")
    split: dict[str, float] = defaultdict(float)
    total = 0.0
    for event in prof.key_averages(group_by_input_shape=True):
        ms = event.self_cpu_time_total / 20 / 1e3
        total += ms
        if any(k in event.key for k in MATMULS):
            split[f"{event.key} {event.input_shapes[:2]}"] += ms
    matmul = sum(split.values())
    print(f"profiled step {total:.2f} ms: matmuls {matmul:.2f} ms, the rest {total - matmul:.2f} ms")
    for key, ms in sorted(split.items(), key=lambda kv: -kv[1]):
        print(f"  {ms:6.2f} ms  {key}")
    nbytes, bandwidth = weight_bytes(decoder), read_bandwidth()
    floor = nbytes / bandwidth / 1e9
    print(f"weights read per step {nbytes / 1e6:.0f} MB; read bandwidth {bandwidth:.1f} GB/s; floor "
          f"{floor * 1e3:.1f} ms ({1 / floor:.0f} tok/s); step / floor {step / floor:.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
