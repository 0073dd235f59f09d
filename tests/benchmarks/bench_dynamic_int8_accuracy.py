"""What FBGEMM's dynamic int8 linear would cost the bundled model in accuracy (issue #17, speed follow-up).

    python tests/benchmarks/bench_dynamic_int8_accuracy.py --int8 INT8_DIR [--model BASELINE_DIR] \
        [--dataset /work/shared/data/wikitext-2/test.txt] [--tokens 8192] [--window 256] [--threads 2] \
        [--variant weight-only] [--variant dynamic:rr=0] [--variant dynamic:rr=0:head] \
        [--variant dynamic:rr=0:qkv,gate_up] ...

``torch.ops.quantized.linear_dynamic`` reads int8 weights near the memory bandwidth at one row (README, CPU
section), but it quantizes the activation row too: uint8, one scale and zero point over [min(x, 0),
max(x, 0)] (7 bits with ``reduce_range``). This measures what that does to the model before anything is
built on it. Every variant runs the static decoder on ``INT8_DIR`` (an int8 RTN checkpoint from
``squeezeserve compress --method int8``) in bfloat16, and a dynamic variant replaces the chosen projections
by the real op fed **one row at a time**, as single-stream decode would run it (so a window's positions
never share a scale). The text is cut into windows of ``--window`` tokens (each scored from its second
token); against the float32 baseline on the same windows it prints perplexity, mean KL(P_fp32 || Q) and
top-1 agreement after every window (printed only: no CSV for accuracy).

Variants: ``bf16`` (the baseline in bfloat16), ``weight-only`` (the int8 checkpoint's packed
``_weight_int8pack_mm`` path), and ``dynamic:rr=0|1[:head][:PROJ,...]`` with PROJ among qkv, o, gate_up,
down (default all four) and ``head`` = the tied lm_head quantized per channel (RTN) and run dynamic too.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, str(Path(__file__).parent))
from cpu_common import cpu_description  # noqa: E402

from squeezeserve.service.models.loader import load_model  # noqa: E402
from squeezeserve.service.worker.local.decoder import Int8Linear, StaticDecoder  # noqa: E402

PROJECTIONS = ("qkv", "o", "gate_up", "down")
DEFAULT_MODEL = Path(os.environ.get("SQUEEZESERVE_HOME", "~/.cache/squeezeserve")).expanduser() / (
    "models/smollm2-135m-instruct"
)


class DynamicRows:
    """y = quantized.linear_dynamic(x_row) for every row of x on its own: int8 weights ``q`` [N, K] with one
    scale per output channel, prepacked once for FBGEMM."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, reduce_range: bool) -> None:
        zeros = torch.zeros(q.shape[0], dtype=torch.long)
        weight = torch._make_per_channel_quantized_tensor(q.contiguous(), scale.double(), zeros, 0)
        self.packed = torch.ops.quantized.linear_prepack(weight, None)
        self.reduce_range = reduce_range

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        out = [torch.ops.quantized.linear_dynamic(rows[i : i + 1], self.packed, self.reduce_range) for i in
               range(rows.shape[0])]  # fmt: skip
        return torch.cat(out).view(*x.shape[:-1], -1).to(x.dtype)


def per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric RTN, one scale per row: q = round(w / s) in [-127, 127], s = max|w_row| / 127."""
    w = weight.float()
    scale = w.abs().amax(1).clamp(min=1e-12) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def build(variant: str, baseline: Path, int8: Path) -> StaticDecoder:
    if variant == "bf16":
        return StaticDecoder(load_model(baseline, dtype="bfloat16").model, 1)
    decoder = StaticDecoder(load_model(int8, dtype="bfloat16", quantized_linear="kernel").model, 1)
    if variant == "weight-only":
        return decoder
    kind, *options = variant.split(":")
    if kind != "dynamic" or not options or options[0] not in ("rr=0", "rr=1"):
        raise SystemExit(f"unknown variant {variant!r}")
    reduce_range = options[0] == "rr=1"
    chosen = PROJECTIONS
    for option in options[1:]:
        if option != "head":
            chosen = tuple(option.split(","))
    for layer in decoder.layers:
        for name in chosen:
            linear = getattr(layer, name)
            if not isinstance(linear, Int8Linear) or linear.bias is not None:
                raise SystemExit(f"{name} is not a bias-free packed int8 linear: {type(linear).__name__}")
            setattr(layer, name, DynamicRows(linear.q, linear.scale, reduce_range))
    if "head" in options:
        decoder.lm_head = DynamicRows(*per_channel_int8(decoder.lm_head.weight), reduce_range)
    return decoder


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the bfloat16 baseline checkpoint")
    parser.add_argument("--int8", type=Path, required=True, help="int8 RTN checkpoint of the same model")
    parser.add_argument("--dataset", type=Path, default=Path("/work/shared/data/wikitext-2/test.txt"))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variant", action="append", help="repeatable; default: the set in the docstring")
    args = parser.parse_args()
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise SystemExit("this torch has no FBGEMM (x86 builds only)")
    warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
    torch.set_num_threads(args.threads)
    variants = args.variant or ["bf16", "weight-only", "dynamic:rr=1", "dynamic:rr=0", "dynamic:rr=0:head"]
    cpu, flags = cpu_description()
    print(
        f"{cpu} ({flags}); torch {torch.__version__}; {args.threads} threads; load {os.getloadavg()[0]:.1f}"
    )

    reference = StaticDecoder(load_model(args.model, dtype="float32").model, 1)
    tokenizer = load_model(args.model, dtype="float32").tokenizer
    ids = tokenizer(args.dataset.read_text())["input_ids"][: args.tokens]
    windows = [ids[i : i + args.window] for i in range(0, len(ids) - args.window + 1, args.window)]
    decoders = {name: build(name, args.model, args.int8) for name in variants}
    totals = {name: [0.0, 0.0, 0] for name in ["fp32 baseline", *decoders]}  # -log p, KL, top-1 agreements
    scored, start = 0, time.perf_counter()
    with torch.inference_mode():
        for index, window in enumerate(windows):
            target = torch.tensor(window[1:])
            reference.reset()
            p = F.log_softmax(reference.prefill(window, True)[:-1].float(), -1)
            best = p.argmax(-1)
            totals["fp32 baseline"][0] += float(F.nll_loss(p, target, reduction="sum"))
            totals["fp32 baseline"][2] += len(target)
            for name, decoder in decoders.items():
                decoder.reset()
                q = F.log_softmax(decoder.prefill(window, True)[:-1].float(), -1)
                totals[name][0] += float(F.nll_loss(q, target, reduction="sum"))
                totals[name][1] += float((p.exp() * (p - q)).sum())
                totals[name][2] += int((q.argmax(-1) == best).sum())
            scored += len(target)
            elapsed = time.perf_counter() - start
            print(f"\nwindow {index + 1}/{len(windows)}, {scored} tokens scored, {elapsed:.0f} s, "
                  f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
            base = math.exp(totals["fp32 baseline"][0] / scored)
            print("| variant | ppl | ppl / fp32 | mean KL vs fp32 | top-1 agreement vs fp32 |")
            print("|---|---:|---:|---:|---:|")
            for name, (nll, kl, agree) in totals.items():
                ppl = math.exp(nll / scored)
                print(f"| {name} | {ppl:.3f} | {ppl / base:.4f} | {kl / scored:.5f} | {agree / scored:.4f} |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
