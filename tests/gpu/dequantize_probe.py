"""Dequantize + cuBLAS on packed against owned words (quant_layout.to_owned_order / to_owned_zeros), the
expansion kernel alone and the prefill product it serves past the Gluon GEMM's rows, in interleaved rounds
(cold weights and CUDA graphs, as bench_quant_matmul.py times them). H100.

The thirty-second session measured owned words with g32 zero points 3-12% behind packed ones at 2048-4096
rows of the 8B model's down_proj and 14336 x 4096, in one pass each, while their expansion kernels compile
to the same instructions but a handful (tests/benchmarks/NOTES.md); the rounds here tell a gap from the
spread between passes.

    python tests/gpu/dequantize_probe.py [--groups 32z,128] [--shapes 14336:4096,...] [--ms 2048,4096]
        [--tiles 8x1024,4x2048]   # other tiles of the dequantize kernel (rows x K) beside the shipped one
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_quant_matmul import _copies, _cycle, _packed  # noqa: E402

from squeezeserve.kernels import quant_layout as ql  # noqa: E402
from squeezeserve.kernels.ops import quant_matmul as qm  # noqa: E402

SHAPES = "14336:4096,4096:14336"  # K:N (down_proj, 14336 x 4096)


def weights(n: int, k: int, group: int, zeros: bool) -> dict:
    """words -> [(qweight, scales, zeros)] copies enough to stream from DRAM, packed and owned."""
    qw, sc, zp = _packed(n, k, 4, group, zeros)
    packed = [(qw, sc, zp)] + [
        (qw.clone(), sc.clone(), None if zp is None else zp.clone())
        for _ in range(_copies(qw.numel() * 4) - 1)
    ]
    owned = [(ql.to_owned_order(q), s, None if z is None else ql.to_owned_zeros(z, n)) for q, s, z in packed]
    return {"packed": packed, "owned": owned}


def timers(words: dict, x: torch.Tensor | None, k: int, group: int) -> dict:
    """words -> a callable for do_bench_cudagraph: the expansion alone (``x`` None) or the product."""
    return {
        kind: _cycle([_timer(w, x, k, group, kind == "owned") for w in copies])
        for kind, copies in words.items()
    }


def _timer(weight: tuple, x: torch.Tensor | None, k: int, group: int, owned: bool):
    q, s, z = weight
    if x is None:
        buffer = torch.empty(q.shape[0], k, device="cuda", dtype=torch.bfloat16)
        return lambda: qm.dequantize(q, s, z, k, group, 4, torch.bfloat16, buffer, owned)
    slices = qm._slice_rows(x, q, s, z)
    return lambda: qm.dequantize_matmul(x, q, s, z, k, group, 4, slices, owned=owned)


def _tile(tile: tuple, shipped: tuple) -> str:
    return "" if tile == shipped else f" {tile[0]}x{tile[1]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", default="32z,128", help="groups, z: with zero points")
    ap.add_argument("--shapes", default=SHAPES, help="K:N pairs")
    ap.add_argument("--ms", default="2048,3072,4096", help="rows of the products (0: the expansion alone)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tiles", default="", help="dequantize tiles ROWSxK to time beside the shipped one")
    args = ap.parse_args()
    shipped = qm.DEQUANT_TILE
    tiles = [shipped] + [tuple(map(int, t.split("x"))) for t in args.tiles.split(",") if t]
    print(f"# {torch.cuda.get_device_name()}; us, min / median of {args.rounds} interleaved rounds")
    for spec in args.groups.split(","):
        group, zeros = int(spec.rstrip("z")), spec.endswith("z")
        for k, n in (map(int, pair.split(":")) for pair in args.shapes.split(",")):
            words = weights(n, k, group, zeros)
            q, s, z = words["packed"][0]
            expanded = qm.dequantize(q, s, z, k, group, 4, torch.bfloat16)
            for tile in tiles:  # every tile expands both words bit for bit as the shipped one
                qm.DEQUANT_TILE = tile
                for kind, copies in words.items():
                    got = qm.dequantize(*copies[0], k, group, 4, torch.bfloat16, owned=kind == "owned")
                    assert torch.equal(expanded, got), (kind, tile)
            qm.DEQUANT_TILE = shipped
            for m in [0, *(int(v) for v in args.ms.split(",") if v)]:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) if m else None
                fns = timers(words, x, k, group)
                times = {(kind, tile): [] for kind in fns for tile in tiles}
                for _ in range(args.rounds):
                    for kind, tile in times:
                        qm.DEQUANT_TILE = tile  # (read when the graph captures the call)
                        times[kind, tile].append(do_bench_cudagraph(fns[kind]) * 1000)
                qm.DEQUANT_TILE = shipped
                row = " | ".join(
                    f"{kind}{_tile(tile, shipped)} {min(t):.1f} / {statistics.median(t):.1f}"
                    for (kind, tile), t in times.items()
                )
                ratio = statistics.median(times["owned", shipped]) / statistics.median(
                    times["packed", shipped]
                )
                what = f"{m} rows" if m else "expansion"
                print(f"g{spec} {n}x{k} {what}: {row} | owned / packed {ratio:.3f}", flush=True)
            del words


if __name__ == "__main__":
    main()
