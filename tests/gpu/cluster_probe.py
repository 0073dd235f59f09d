"""Issue 16 item 2: the Gluon prefill GEMM in clusters of two programs that share x's tiles (TMA multicast,
``ptx_cluster``), against the same tiling a program alone: bit for bit, then the time.

    python tests/gpu/cluster_probe.py [--ms 2048,8192] [--shapes 14336x14336,gate_up] [--group 128] [--zeros]
        [--tiles 256:4:1,256:4:1:c,256:4:P132:c]

Each tiling (gluon_prefill_probe's notation; whole tiles only) is first checked exactly against the first
(the same products in the same order: y must be equal, bit for bit, including rows past the last whole
tile), then timed with cold weights (copies past the L2,
each call in a CUDA graph) in interleaved rounds beside bf16 cuBLAS on the dequantized weight, quant_matmul
as it stands (``rule``) and, with ``--machete``, vLLM's Machete (vLLM staged). The weights are on the words
the vLLM method serves them on (``vllm_ops.owned_shape``) unless ``--words`` says otherwise.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

from squeezeserve.kernels.ops import quant_matmul as qm
from squeezeserve.kernels.ops import quant_matmul_gluon as qg

sys.path.insert(0, str(Path(__file__).parent))
from gluon_prefill_probe import cold_copies, cycle, machete, served_weights, tiling  # noqa: E402
from prefill_tiling_probe import SHAPES  # noqa: E402


def rounds(columns: dict, count: int, prefix: str) -> dict[str, float]:
    """Time each column's calls (cycled through: cold copies) in ``count`` interleaved rounds, printing each
    round; each column's median, in us."""
    times: dict[str, list[float]] = {c: [] for c in columns}
    for r in range(count):
        for label, calls in columns.items():
            times[label].append(do_bench_cudagraph(cycle(calls), rep=60) * 1e3)
        cells = " | ".join(f"{label} {ts[-1]:.1f}" for label, ts in times.items())
        print(f"{prefix} round {r}: {cells}", flush=True)
    return {label: statistics.median(ts) for label, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="2048,8192")
    ap.add_argument("--shapes", default="14336x14336,gate_up,14336x4096")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--zeros", action="store_true")
    ap.add_argument("--check-ms", default="100,300,2000")
    ap.add_argument("--tiles", default="256:4:1,256:4:1:c")
    ap.add_argument("--rounds", type=int, default=3)
    # (the words: as the vLLM method serves the weight, vllm_ops.owned_shape, or all alike)
    ap.add_argument("--words", choices=("served", "packed", "owned"), default="served")
    ap.add_argument("--machete", action="store_true")  # (vLLM staged)
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}; g{args.group}{' zero points' if args.zeros else ''}; "
          f"tilings {args.tiles}; us (x bf16 cuBLAS); rounds interleaved, then each column's median",
          flush=True)  # fmt: skip
    tilings = {spec: tiling(spec) for spec in args.tiles.split(",")}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        qw, sc, zp, dense, owned = served_weights(n, k, args.group, args.zeros, args.words)
        for m in [int(v) for v in args.check_ms.split(",") if v]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = (x @ dense.t()).float()
            first = None
            ws, counts = qm._workspace(x.device, m * n, 4096)
            for spec, cfg in tilings.items():
                y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)  # (as served: y in x's dtype)
                qg.launch(x, qw, sc, zp, args.group, y, ws, counts, mode=2, owned=owned, **cfg)
                torch.cuda.synchronize()
                first = y if first is None else first
                same = torch.equal(first, y)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                print(
                    f"check {name} m={m} {spec}: bit-exact {same}, rel err against cuBLAS {err:.2e}",
                    flush=True,
                )
                assert same, f"{name} m={m}: {spec}'s products differ from the first tiling's"
                assert err < 4e-3, f"{name} m={m} {spec}: rel err {err}"  # (both sides rounded to bf16)
        packs, denses = cold_copies(qw, sc, zp, dense)
        op = qm._quant_matmul_owned if owned else functools.partial(qm._quant_matmul, bits=4)
        peer = machete(dense, args.group) if args.machete else []
        for m in [int(v) for v in args.ms.split(",") if v]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            columns = {
                "bf16": [lambda d=d, x=x: x @ d.t() for d in denses],
                "rule": [functools.partial(op, x, *p, args.group) for p in packs],
                **{
                    spec: [
                        functools.partial(qg.launch, x, *p, args.group, y, y, y, owned=owned, **cfg)
                        for p in packs
                    ]
                    for spec, cfg in tilings.items()
                },
                **({"machete": [lambda f=f, x=x: f(x) for f in peer]} if peer else {}),
            }
            med = rounds(columns, args.rounds, f"{name} m={m}{' owned' if owned else ''}")
            cells = " | ".join(f"{label} {us:.1f} ({med['bf16'] / us:.3f}x)" for label, us in med.items())
            vs = (
                "".join(f" | {spec} / machete {med['machete'] / med[spec]:.3f}x" for spec in tilings)
                if peer
                else ""
            )
            print(f"{name} m={m} median: {cells}{vs}", flush=True)


if __name__ == "__main__":
    main()
