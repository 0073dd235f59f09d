"""Device probe for issue #16 item 3 (TTFT under load): host and GPU time of the 8B layer's four prompt GEMMs
past the Gluon GEMM's rows, as vLLM's method calls them eagerly (``quant_matmul_eager``; owned words where
``vllm_ops.owned_shape`` repacks them), on the path PREFILL's rule picks (the Gluon GEMM to
``gluon_prefill_max_m`` rows, then dequantize + cuBLAS, in slices of DEQUANT_SLICE_ROWS weight rows where K
is short) and on the Gluon GEMM at every row count (its limits raised); ``--slice-rows`` adds the rule with
other slice sizes (fewer slices, less host time); ``--parts`` times a slice's pieces alone on gate_up (the
dequantize launch, the slice's views, its cuBLAS call through ``torch.matmul`` and ``torch.mm``);
``--dequantize-host`` only where a dequantize launch's host time goes (calls a round, cProfile).

vLLM runs prompt steps past its largest CUDA graph eagerly: where a layer's host time (Python, launches)
exceeds its GPU time, the GPU waits on the host. ``run_h100.sh serve-prof`` (vLLM's profiler in a server)
found our steps of 2049-4096 rows spanning twice their kernels' time, the profiler's own per-op cost
included; this measures the host without a profiler.

Host: microseconds a call to enqueue ``--calls`` calls behind a GPU sleep (the launch queue holds them all,
so nothing waits on the GPU). GPU: CUDA events around the same calls, the first event recorded after the
sleep (every call already enqueued). The minimum of ``--rounds`` rounds each.

    python3 tests/gpu/prefill_host_probe.py [--ms 2064,3072,4096,6144,8192] [--group 128] [--parts]
        [--slice-rows 2048,...] [--dequantize-host]
"""

from __future__ import annotations

import argparse
import time

import torch

from squeezeserve.kernels import quant_layout, vllm_ops
from squeezeserve.kernels.ops import quant_matmul as qm
from squeezeserve.kernels.registry import direct_launches

SHAPES = {
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
}
SLEEP_CYCLES = 300_000_000  # ~0.17 s at the H100's 1.75 GHz: longer than any round's enqueueing


def layer_weights(group: int) -> dict:
    weights = {}
    for name, (n, k) in SHAPES.items():
        packed = quant_layout.pack_weight(
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64, 4, group
        )
        qweight, scales = packed["weight_packed"], packed["weight_scale"].to(torch.bfloat16)
        owned = vllm_ops.owned_shape(n, k, group, False)
        weights[name] = (vllm_ops.to_owned(qweight) if owned else qweight, scales, owned)
    return weights


def gemm(x: torch.Tensor, weight: tuple, group: int) -> torch.Tensor:
    qweight, scales, owned = weight
    if owned:
        return qm.quant_matmul_owned_eager(x, qweight, scales, None, group)
    return qm.quant_matmul_eager(x, qweight, scales, None, group, 4)


def timed(fn, calls: int) -> tuple[float, float]:
    """(host us, GPU us) a call: ``calls`` calls enqueued behind a GPU sleep."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) * 1e6 / calls
    end.record()
    end.synchronize()
    return host, start.elapsed_time(end) * 1e3 / calls


def second_slice(weight: tuple, group: int):
    """gate_up's second DEQUANT_SLICE_ROWS slice (views with an offset, as dequantize_matmul's loop takes
    them): (the slice, its buffer, a call that dequantizes it into the buffer as the op launches it: outside
    an op, a launch goes through torch's wrap_triton)."""
    qweight, scales, owned = weight
    k, rows = SHAPES["gate_up_proj"][1], qm.DEQUANT_SLICE_ROWS
    part = slice(rows, 2 * rows)
    buffer = torch.empty(rows, k, device="cuda", dtype=torch.bfloat16)

    def expand():
        with direct_launches:
            return qm.dequantize(qweight[part], scales[part], None, k, group, 4, buffer.dtype, buffer, owned)

    return part, buffer, expand


def slice_parts(m: int, weight: tuple, group: int, calls: int, rounds: int) -> None:
    """Host and GPU us of one DEQUANT_SLICE_ROWS slice's pieces on gate_up at ``m`` rows."""
    qweight, scales, _ = weight
    (n, k), rows = SHAPES["gate_up_proj"], qm.DEQUANT_SLICE_ROWS
    part, buffer, expand = second_slice(weight, group)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = x.new_empty((m, n))

    def views():
        return qweight[part], scales[part], buffer[:rows], y[:, part]

    w = expand()
    parts = {
        "views": views,
        "dequantize": expand,
        "torch.matmul(out=)": lambda: torch.matmul(x, w.t(), out=y[:, part]),
        "torch.mm(out=)": lambda: torch.mm(x, w.t(), out=y[:, part]),
        "torch.mm (new)": lambda: torch.mm(x, w.t()),
    }
    for name, fn in parts.items():
        fn()
        runs = [timed(fn, calls) for _ in range(rounds)]
        host, gpu = min(r[0] for r in runs), min(r[1] for r in runs)
        print(f"{m:5d} rows gate_up slice of {rows}: {name:20s} host {host:7.1f} us, GPU {gpu:8.1f} us")


def dequantize_host(weight: tuple, group: int, rounds: int) -> None:
    """Where a lone dequantize launch's host time goes: its host time behind a GPU sleep at 1-64 calls a
    round, then 200 calls under cProfile (the top functions by own time)."""
    import cProfile
    import pstats

    k, rows = SHAPES["gate_up_proj"][1], qm.DEQUANT_SLICE_ROWS
    _, _, expand = second_slice(weight, group)
    expand()
    for calls in (1, 8, 64):
        runs = [timed(expand, calls) for _ in range(rounds)]
        host = min(r[0] for r in runs)
        print(f"dequantize {rows} x {k}, {calls:2d} calls a round: host {host:7.1f} us a call")
    x = torch.randn(6144, k, device="cuda", dtype=torch.bfloat16)
    for label, fn, calls in (
        ("dequantize", expand, 200),
        ("gate_up at 6144 rows", lambda: gemm(x, weight, group), 20),
    ):
        fn()
        torch.cuda.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(calls):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        print(f"{label}, {calls} calls under cProfile:")
        pstats.Stats(profile).sort_stats("tottime").print_stats(14)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ms", default="2064,3072,4096,6144,8192")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--slice-rows", default="", help="also the rule with these DEQUANT_SLICE_ROWS (comma list)"
    )
    parser.add_argument("--parts", action="store_true", help="then a slice's pieces alone, on gate_up")
    parser.add_argument("--dequantize-host", action="store_true", help="only where a dequantize's host goes")
    args = parser.parse_args()
    limits = f"GLUON_PREFILL_MAX_M {qm.GLUON_PREFILL_MAX_M}, _SLICED {qm.GLUON_PREFILL_MAX_M_SLICED}"
    print(f"{torch.cuda.get_device_name()}; {limits}; g{args.group}", flush=True)
    weights = layer_weights(args.group)
    if args.dequantize_host:
        return dequantize_host(weights["gate_up_proj"], args.group, args.rounds)
    rule = (qm.GLUON_PREFILL_MAX_M, qm.GLUON_PREFILL_MAX_M_SLICED, qm.DEQUANT_SLICE_ROWS)
    paths = {"rule": rule, "gluon": (1 << 20, 1 << 20, qm.DEQUANT_SLICE_ROWS)}
    for rows in (int(v) for v in args.slice_rows.split(",") if v):
        paths[f"rule, {rows}-row slices"] = rule[:2] + (rows,)
    for m in (int(v) for v in args.ms.split(",")):
        per_path = {}
        for path, max_m in paths.items():
            qm.GLUON_PREFILL_MAX_M, qm.GLUON_PREFILL_MAX_M_SLICED, qm.DEQUANT_SLICE_ROWS = max_m
            qm.quant_matmul_eager.plans.clear()  # (plans are per signature, not per path)
            qm.quant_matmul_owned_eager.plans.clear()
            layer = {}
            for name, weight in weights.items():
                x = torch.randn(m, SHAPES[name][1], device="cuda", dtype=torch.bfloat16)
                fn = lambda x=x, w=weight: gemm(x, w, args.group)  # noqa: E731
                for _ in range(3):  # compiles, records the launch plan
                    fn()
                runs = [timed(fn, args.calls) for _ in range(args.rounds)]
                best = [min(r[0] for r in runs), min(r[1] for r in runs)]
                layer[name] = best
                print(
                    f"{m:5d} rows {name:12s} {path}: host {best[0]:8.1f} us, GPU {best[1]:8.1f} us",
                    flush=True,
                )
            per_path[path] = [sum(v[i] for v in layer.values()) for i in range(2)]
        qm.GLUON_PREFILL_MAX_M, qm.GLUON_PREFILL_MAX_M_SLICED, qm.DEQUANT_SLICE_ROWS = rule
        print(
            f"{m:5d} rows, the layer's four GEMMs: "
            + "; ".join(f"{p} host {h:.0f} us, GPU {g:.0f} us" for p, (h, g) in per_path.items()),
            flush=True,
        )
    if args.parts:
        for m in (int(v) for v in args.ms.split(",")):
            slice_parts(m, weights["gate_up_proj"], args.group, args.calls, args.rounds)


if __name__ == "__main__":
    main()
