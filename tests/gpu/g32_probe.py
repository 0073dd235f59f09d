"""Device probe for issue #16 item 1: int4 group-32 decode (what ``squeezeserve compress --method int4``
writes by default) on the tensor-core kernel, read as bytes with the scale after each group's dots, against
the per-weight dequantization it replaced, vLLM's Marlin at group 32 and bf16 cuBLAS.

Per (K, N) and rows M: each path's time (CUDA graph replay over cold weight copies, as
bench_quant_matmul.py times them) and its speedup over bf16; pieces per tile 1, 2 and 4 (``SUB_MAX``);
symmetric and with zero points. ``--sweep``: tiles of each tensor-core variant; the FMA kernel at 2-8 rows.

    python3 tests/gpu/g32_probe.py            # vLLM on PYTHONPATH for the Marlin column
    python3 tests/gpu/g32_probe.py --sweep    # tiles of each variant; the FMA kernel at 2-8 rows
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from bench_quant_matmul import _copies, _cycle, marlin_timer  # noqa: E402

import squeezeserve.kernels as K  # noqa: E402
from squeezeserve.kernels import quant_layout  # noqa: E402
from squeezeserve.kernels.ops import quant_matmul as qm  # noqa: E402

DTYPE = torch.bfloat16
KN = [(4096, 4096), (4096, 14336), (14336, 4096), (14336, 14336)]
MS = (1, 2, 4, 8, 16, 32, 64)
GROUP = 32
TILE_K = qm._tile_k


def prescale_tile(group_size, k_in, bits):
    """The tile choice before the byte path: a 256-deep PRESCALE tile of int16 words."""
    return 256, True, 16, 1


# (label, tile choice, SUB_MAX): one row count takes the FMA kernel (M = 1) whatever the tile choice.
PATHS = [("prescale", prescale_tile, 4), ("bytes1", TILE_K, 1), ("bytes2", TILE_K, 2), ("bytes4", TILE_K, 4)]


class Rec:
    """The slice of bench_quant_matmul's recorder that marlin_timer uses: times one graph, in ms."""

    def time(self, name, mode, shape, dtype, fn, nbytes=None, graph=True):
        return do_bench_cudagraph(fn, rep=30)


def timed(packs, x, zeros=False):
    return do_bench_cudagraph(
        _cycle([lambda p=p: K.quant_matmul(x, p[0], p[1], p[2] if zeros else None, GROUP, 4) for p in packs]),
        rep=30,
    )


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    marlin = marlin_timer()
    for k, n in KN:
        weight = torch.randn(n, k, device="cuda", dtype=DTYPE) / 64
        t = quant_layout.pack_weight(weight, 4, GROUP, symmetric=False)
        qw, sc, zp = t["weight_packed"], t["weight_scale"], t["weight_zero_point"]
        sym = quant_layout.pack_weight(weight, 4, GROUP)
        nbytes = qw.numel() * 4 + sc.numel() * 2
        packs = [(qw, sc, zp)] + [(qw.clone(), sc.clone(), zp.clone()) for _ in range(_copies(nbytes) - 1)]
        first = (sym["weight_packed"], sym["weight_scale"], None)
        sym_packs = [first] + [(first[0].clone(), first[1].clone(), None) for _ in range(len(packs) - 1)]
        dense = quant_layout.dequantize(sym["weight_packed"], sym["weight_scale"], None, (n, k), GROUP, 4)
        dense = dense.to(DTYPE)
        denses = [dense] + [dense.clone() for _ in range(_copies(dense.numel() * 2) - 1)]
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            t_bf16 = do_bench_cudagraph(_cycle([lambda d=d, x=x: x @ d.t() for d in denses]), rep=30)
            row = {"bf16": t_bf16}
            ref = (x @ dense.t()).float()
            for label, tile, sub in PATHS:
                qm._tile_k, qm.SUB_MAX = tile, sub
                try:
                    y = K.quant_matmul(x, *sym_packs[0][:2], None, GROUP, 4).float()
                    err = ((y - ref).norm() / ref.norm()).item()
                    assert err < 1e-2, (label, m, n, k, err)
                    row[label] = timed(sym_packs, x)
                    if label in ("prescale", "bytes4"):
                        row[label + "+zp"] = timed(packs, x, zeros=True)
                finally:
                    qm._tile_k, qm.SUB_MAX = TILE_K, 4
            if m == 1:  # the tensor-core byte path at one row too (GEMV_MAX_M = 0)
                qm.GEMV_MAX_M = 0
                try:
                    row["bytes4-mma"] = timed(sym_packs, x)
                finally:
                    qm.GEMV_MAX_M = 1
            if marlin is not None:
                row["marlin"] = marlin(Rec(), m, n, k, GROUP, x, dense, (m, n, k), nbytes)
            print(f"m={m} k={k} n={n}: " + "  ".join(f"{key} {v * 1e3:.1f}us ({t_bf16 / v:.2f}x)"
                                                      for key, v in row.items()), flush=True)  # fmt: skip


# Variants of the tensor-core kernel at group 32: (tile choice, NATIVE_PRESCALE).
VARIANTS = {
    "prescale": (prescale_tile, False),
    "prescale-native": (prescale_tile, True),
    "bytes1": (TILE_K, False),
}


def sweep() -> None:
    """Tiles of each variant at group 32 (BLOCK_N, stages, split; 4 warps), best five and the default; then
    the FMA kernel at 2-8 rows (GEMV_MAX_M raised) at groups 32 and 128."""
    saved = qm.tuning
    grid = list(itertools.product((64, 128, 256), (4,), (3, 4), (4, 8, 16)))
    for k, n in [(4096, 4096), (4096, 14336), (14336, 4096)]:
        t = quant_layout.pack_weight(torch.randn(n, k, device="cuda", dtype=DTYPE) / 64, 4, GROUP)
        qw, sc = t["weight_packed"], t["weight_scale"]
        copies = _copies(qw.numel() * 4)
        packs = [(qw, sc, None)] + [(qw.clone(), sc.clone(), None) for _ in range(copies - 1)]
        for m in (4, 16, 64):
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            for label, (tile, native) in VARIANTS.items():
                qm._tile_k, qm.SUB_MAX, qm.NATIVE_PRESCALE = tile, 1, native
                results = []
                for bn, warps, stages, split in grid:
                    cfg = {"BLOCK_N": bn, "split": split, "num_warps": warps, "num_stages": stages}
                    qm.tuning = lambda *a, cfg=cfg: cfg
                    try:
                        results.append((timed(packs, x), bn, warps, stages, split))
                    except Exception as exc:  # out of shared memory / registers
                        print(f"# {cfg}: {type(exc).__name__}", file=sys.stderr)
                    finally:
                        qm.tuning = saved
                results.sort()
                t_default = timed(packs, x)
                qm._tile_k, qm.SUB_MAX, qm.NATIVE_PRESCALE = TILE_K, 4, False
                print(f"sweep {label} m={m} k={k} n={n}: " + "; ".join(
                    f"{t * 1e3:.1f}us bn{bn} w{w} s{st} split{sp}" for t, bn, w, st, sp in results[:4])
                    + f" | default {t_default * 1e3:.1f}us", flush=True)  # fmt: skip
    for group in (32, 128):
        for k, n in [(4096, 4096), (4096, 14336), (14336, 4096)]:
            t = quant_layout.pack_weight(torch.randn(n, k, device="cuda", dtype=DTYPE) / 64, 4, group)
            qw, sc = t["weight_packed"], t["weight_scale"]
            copies = _copies(qw.numel() * 4)
            packs = [(qw, sc)] + [(qw.clone(), sc.clone()) for _ in range(copies - 1)]
            for m in (1, 2, 4, 8):
                x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                fn = _cycle(
                    [lambda p=p, x=x, g=group: K.quant_matmul(x, p[0], p[1], None, g, 4) for p in packs]
                )
                t_mma = do_bench_cudagraph(fn, rep=30)
                qm.GEMV_MAX_M = 64
                try:
                    t_fma = do_bench_cudagraph(fn, rep=30)
                finally:
                    qm.GEMV_MAX_M = 1
                print(f"fma m={m} k={k} n={n} g={group}: shipped {t_mma * 1e3:.1f}us, "
                      f"FMA kernel {t_fma * 1e3:.1f}us", flush=True)  # fmt: skip


if __name__ == "__main__":
    if "--sweep" in sys.argv:
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
        sweep()
    else:
        main()
