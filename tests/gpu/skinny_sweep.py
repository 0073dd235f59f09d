"""Tile sweep of quant_matmul's tensor-core decode kernel (``_skinny_kernel``), int4, on a GPU.

For int4 g128, g32 and g32 with zero points (the formats ``squeezeserve compress`` writes), the four
(K, N) shapes of issue 16 and the given rows, it times the shipped setting and every (BLOCK_N, warps,
stages, split) of a grid forced into ``quant_matmul.tuning``, and prints one JSON line per point with the
shipped time and the best four (us; CUDA graph replay over cold weight copies, as bench_quant_matmul.py
times them). The grid at 64 rows differs: 64-row tiles leave room for one program an SM, so fewer, wider
programs and 2 stages are in it.

    python3 tests/gpu/skinny_sweep.py          # 4 and 16 rows
    python3 tests/gpu/skinny_sweep.py 64       # 64 rows (what quant_matmul.tuning's m > 32 rule came from)
    python3 tests/gpu/skinny_sweep.py 4,16 deep  # deeper pipelines (3-6 stages) and the splits between 4
                                                 # and 16 (the grid count of a 14336-wide output), g128
                                                 # and g32 with zero points, the shapes with a 14336 side
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from bench_quant_matmul import KN, _copies, _cycle  # noqa: E402

import squeezeserve.kernels as K  # noqa: E402
from squeezeserve.kernels import quant_layout  # noqa: E402
from squeezeserve.kernels.ops import quant_matmul as qm  # noqa: E402


def grid(rows: list[int], deep: bool = False) -> list[tuple]:
    if deep:
        return list(itertools.product((64, 128), (4,), (3, 4, 5, 6), (4, 7, 8, 9, 14, 16)))
    if rows == [64]:
        return list(itertools.product((64, 128), (4, 8), (2, 3, 4), (1, 2, 4, 8)))
    return list(itertools.product((64, 128, 256), (4,), (3, 4), (2, 4, 8, 16)))


def main() -> None:
    rows = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [4, 16]
    deep = sys.argv[2:] == ["deep"]
    settings, shipped_tuning = grid(rows, deep), qm.tuning
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    formats = ((128, False), (32, True)) if deep else ((128, False), (32, False), (32, True))
    for group, zeros in formats:
        for k, n in [kn for kn in KN if not deep or max(kn) == 14336]:
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
            t = quant_layout.pack_weight(weight, 4, group, symmetric=not zeros)
            qw, sc, zp = t["weight_packed"], t["weight_scale"], t.get("weight_zero_point")
            copies = _copies(qw.numel() * 4 + sc.numel() * 2)
            packs = [(qw, sc, zp)] + [
                (qw.clone(), sc.clone(), None if zp is None else zp.clone()) for _ in range(copies - 1)
            ]
            for m in rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                fn = _cycle(
                    [lambda p=p, x=x, g=group: K.quant_matmul(x, p[0], p[1], p[2], g, 4) for p in packs]
                )
                shipped = do_bench_cudagraph(fn, rep=30)
                results = []
                for bn, warps, stages, split in settings:
                    cfg = {"BLOCK_N": bn, "split": split, "num_warps": warps, "num_stages": stages}
                    qm.tuning = lambda *a, cfg=cfg, **kw: cfg
                    try:
                        results.append((do_bench_cudagraph(fn, rep=20), bn, warps, stages, split))
                    except Exception as exc:  # out of shared memory for the largest tiles
                        print(f"# {cfg}: {type(exc).__name__}", file=sys.stderr)
                    finally:
                        qm.tuning = shipped_tuning
                results.sort()
                best = [[round(r[0] * 1e3, 2), *r[1:]] for r in results[:4]]
                point = {"g": group, "zp": zeros, "k": k, "n": n, "m": m}
                point["shipped_us"] = round(shipped * 1e3, 2)
                print(json.dumps(point | {"best_us_bn_warps_stages_split": best}), flush=True)
            del packs


if __name__ == "__main__":
    main()
