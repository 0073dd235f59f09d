"""Device probe for issue #16 item 1: decode at the formats ``squeezeserve compress`` writes, int4 group 32
(with and without zero points) and int8, against vLLM's Marlin (int4 g32) and bf16 cuBLAS.

Groups of 32 are narrower than a tensor-core dot over the packed int16 words, so the skinny kernel
dequantizes each weight before the dot (PRESCALE). Default: per (K, N) and rows M, ours, ours with zero
points and Marlin (CUDA graph replay over cold weight copies, as bench_quant_matmul.py times them), each
with its speedup over bf16. The sweeps force ``quant_matmul.tuning`` over a tile grid (BLOCK_N, warps,
stages, split) and print the best four beside the shipped choice. The 2026-11-24 log
(results/g32_probe_h100_2026-11-24.log) also holds the variants measured and dropped, from the probe as of
commit 554c95b: int4 read as bytes with the scale after the dot, and the dequantization in fp32.

    python3 tests/gpu/g32_probe.py                 # vLLM on PYTHONPATH for the Marlin column
    python3 tests/gpu/g32_probe.py --sweep [--zp]  # tensor-core tiles at g32 (--zp: with zero points);
                                                   # without --zp also the FMA kernel at 2-8 rows
    python3 tests/gpu/g32_probe.py --sweep-gemv    # one-row FMA kernel tiles at g32, with zero points too
    python3 tests/gpu/g32_probe.py --sweep-int8    # int8 g128 / per channel: tensor-core kernel tiles
    python3 tests/gpu/g32_probe.py --sweep-gemv-narrow  # one-row FMA kernel: narrow N, deep K, g128/g32
    python3 tests/gpu/g32_probe.py --sweep-gemv-rows    # FMA kernel at 2 and 4 rows vs the tensor-core one
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
            y = K.quant_matmul(x, *sym_packs[0][:2], None, GROUP, 4).float()
            ref = (x @ dense.t()).float()
            assert ((y - ref).norm() / ref.norm()).item() < 1e-2, (m, n, k)
            row = {"bf16": t_bf16, "ours": timed(sym_packs, x), "ours+zp": timed(packs, x, zeros=True)}
            if marlin is not None:
                row["marlin"] = marlin(Rec(), m, n, k, GROUP, x, dense, (m, n, k), nbytes)
            print(f"m={m} k={k} n={n}: " + "  ".join(f"{key} {v * 1e3:.1f}us ({t_bf16 / v:.2f}x)"
                                                      for key, v in row.items()), flush=True)  # fmt: skip


def tiles(run, grid) -> str:
    """Time ``run()`` (ms) under each (BLOCK_N, warps, stages, split) of ``grid`` forced into
    ``quant_matmul.tuning``: the best four, and the shipped choice's time."""
    saved, results = qm.tuning, []
    for bn, warps, stages, split in grid:
        cfg = {"BLOCK_N": bn, "split": split, "num_warps": warps, "num_stages": stages}
        qm.tuning = lambda *a, cfg=cfg, **kw: cfg
        try:
            results.append((run(), bn, warps, stages, split))
        except Exception as exc:  # out of shared memory / registers
            print(f"# {cfg}: {type(exc).__name__}", file=sys.stderr)
        finally:
            qm.tuning = saved
    results.sort()
    best = "; ".join(f"{t * 1e3:.1f}us bn{bn} w{w} s{st} split{sp}" for t, bn, w, st, sp in results[:4])
    return f"{best} | shipped {run() * 1e3:.1f}us"


def sweep(zeros: bool = False) -> None:
    """Tiles of the PRESCALE kernel at group 32 (BLOCK_N, stages, split; 4 warps), best four and the shipped
    choice; then the FMA kernel at 2-8 rows (GEMV_MAX_M raised) at groups 32 and 128. ``zeros``: with zero
    points, 4 or 8 warps, 4 and 16 rows, no FMA rows."""
    grid = list(itertools.product((64, 128, 256), (4, 8) if zeros else (4,), (3, 4), (4, 8, 16)))
    for k, n in [(4096, 4096), (4096, 14336), (14336, 4096)]:
        t = quant_layout.pack_weight(torch.randn(n, k, device="cuda", dtype=DTYPE) / 64, 4, GROUP, not zeros)
        qw, sc, zp = t["weight_packed"], t["weight_scale"], t.get("weight_zero_point")
        copies = _copies(qw.numel() * 4)
        packs = [(qw, sc, zp)] + [
            (qw.clone(), sc.clone(), zp if zp is None else zp.clone()) for _ in range(copies - 1)
        ]
        for m in (4, 16) if zeros else (4, 16, 64):
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            print(
                f"sweep m={m} k={k} n={n}: " + tiles(lambda p=packs, x=x: timed(p, x, zeros), grid),
                flush=True,
            )
    for group in () if zeros else (32, 128):
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
                saved = qm.GEMV_MAX_M, qm.GEMV_ROWS_MAX_GROUP
                qm.GEMV_MAX_M = 1
                t_mma = do_bench_cudagraph(fn, rep=30)
                qm.GEMV_MAX_M, qm.GEMV_ROWS_MAX_GROUP = 64, 1 << 30
                try:
                    t_fma = do_bench_cudagraph(fn, rep=30)
                finally:
                    qm.GEMV_MAX_M, qm.GEMV_ROWS_MAX_GROUP = saved
                print(f"fma m={m} k={k} n={n} g={group}: GEMV_MAX_M=1 {t_mma * 1e3:.1f}us, "
                      f"FMA kernel {t_fma * 1e3:.1f}us", flush=True)  # fmt: skip


def sweep_gemv() -> None:
    """Tiles of the one-row FMA kernel (``_gemv_int4_kernel``) at group 32, symmetric and with zero points:
    BLOCK_N, warps, stages, split; best four and the shipped choice."""
    grid = list(itertools.product((32, 64, 128), (4, 8), (3, 4), (4, 8, 16)))
    for group in (GROUP,):
        for k, n in [(4096, 4096), (4096, 14336), (14336, 4096)]:
            t = quant_layout.pack_weight(torch.randn(n, k, device="cuda", dtype=DTYPE) / 64, 4, group, False)
            qw, sc, zp = t["weight_packed"], t["weight_scale"], t["weight_zero_point"]
            copies = _copies(qw.numel() * 4)
            packs = [(qw, sc, zp)] + [(qw.clone(), sc.clone(), zp.clone()) for _ in range(copies - 1)]
            x = torch.randn(1, k, device="cuda", dtype=DTYPE)
            for zeros in (False, True):
                calls = [(x, p[0], p[1], p[2] if zeros else None, group, 4) for p in packs]
                fn = _cycle([lambda a=a: K.quant_matmul(*a) for a in calls])
                run = lambda fn=fn: do_bench_cudagraph(fn, rep=30)  # noqa: E731
                print(f"gemv g={group} zp={zeros} k={k} n={n}: " + tiles(run, grid), flush=True)


def forced_gemv_tiles(fn, grid, check_args, ref) -> list[tuple]:
    """Time ``fn`` under each (BLOCK_N, warps, BLOCK_K, split) of ``grid`` forced into ``quant_matmul.tuning``
    (3 stages), first checking ``K.quant_matmul(*check_args)`` against ``ref`` when given; sorted
    (ms, BLOCK_N, warps, BLOCK_K, split), settings that fail printed and left out."""
    results, saved = [], qm.tuning
    for bn, warps, bk, split in grid:
        cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "split": split, "num_warps": warps, "num_stages": 3}
        qm.tuning = lambda *a, cfg=cfg, **kw: cfg
        try:
            if check_args is not None:
                y = K.quant_matmul(*check_args).float()
                assert ((y - ref).norm() / ref.norm()).item() < 1e-2, cfg
            results.append((do_bench_cudagraph(fn, rep=30), bn, warps, bk, split))
        except Exception as exc:  # registers, shared memory, or a wrong result
            print(f"# {cfg}: {type(exc).__name__} {str(exc)[:120]}", flush=True)
        finally:
            qm.tuning = saved
    return sorted(results)


def sweep_gemv_narrow() -> None:
    """The one-row FMA kernel at the tiles that won the 4-bit codebook's FMA kernel (issue 20: 8 output rows x
    512 columns on 2 warps, no K split), which the shipped grid (32-128 rows, 4-8 warps, split 4-16) never
    reached: BLOCK_N 8-32, BLOCK_K 256-512 (spanning several groups), 2 or 4 warps, split 1-4; groups 128 and
    32, symmetric and with zero points; best four and the shipped choice, and bf16's time."""
    grid = list(itertools.product((8, 16, 32), (2, 4), (256, 512), (1, 2, 4)))
    for k, n in [(4096, 4096), (4096, 14336), (14336, 4096)]:
        weight = torch.randn(n, k, device="cuda", dtype=DTYPE) / 64
        dense = [weight] + [weight.clone() for _ in range(_copies(weight.numel() * 2) - 1)]
        x = torch.randn(1, k, device="cuda", dtype=DTYPE)
        t_bf16 = do_bench_cudagraph(_cycle([lambda d=d, x=x: x @ d.t() for d in dense]), rep=30)
        for group in (128, 32):
            t = quant_layout.pack_weight(weight, 4, group, False)
            qw, sc, zp = t["weight_packed"], t["weight_scale"], t["weight_zero_point"]
            packs = [(qw, sc, zp)] + [
                (qw.clone(), sc.clone(), zp.clone()) for _ in range(_copies(qw.numel() * 4) - 1)
            ]
            ref = x.float() @ quant_layout.dequantize(qw, sc, zp, (n, k), group, 4).float().t()
            for zeros in (False, True):
                calls = [(x, p[0], p[1], p[2] if zeros else None, group, 4) for p in packs]
                fn = _cycle([lambda a=a: K.quant_matmul(*a) for a in calls])
                results = forced_gemv_tiles(fn, grid, (x, qw, sc, zp, group, 4) if zeros else None, ref)
                best = "; ".join(
                    f"{t * 1e3:.2f}us bn{bn} w{w} bk{bk} split{sp}" for t, bn, w, bk, sp in results[:4]
                )
                shipped = do_bench_cudagraph(fn, rep=30)
                print(f"gemv-narrow g={group} zp={zeros} k={k} n={n}: bf16 {t_bf16 * 1e3:.2f}us | {best} | "
                      f"shipped {shipped * 1e3:.2f}us", flush=True)  # fmt: skip


def sweep_gemv_rows() -> None:
    """The FMA kernel at 2 and 4 rows (``GEMV_MAX_M`` raised for the probe) on narrow deep tiles (BLOCK_K 512,
    as one row ships), against the tensor-core kernel at the same rows (2 rows' kernel before GEMV_MAX_M = 2);
    groups 128 and 32, symmetric and with zero points, the four decode shapes; the best four settings and
    the shipped tuning's time, with bf16's. The log of the run that chose GEMV_MAX_M = 2 calls the
    tensor-core column "shipped" and the FMA kernel at that day's one-row tuning "one-row tuning"."""
    grid = list(itertools.product((8, 16, 32), (2, 4), (512,), (1, 2, 4)))
    for k, n in KN:
        weight = torch.randn(n, k, device="cuda", dtype=DTYPE) / 64
        dense = [weight] + [weight.clone() for _ in range(_copies(weight.numel() * 2) - 1)]
        for group in (128, 32):
            t = quant_layout.pack_weight(weight, 4, group, False)
            qw, sc, zp = t["weight_packed"], t["weight_scale"], t["weight_zero_point"]
            packs = [(qw, sc, zp)] + [
                (qw.clone(), sc.clone(), zp.clone()) for _ in range(_copies(qw.numel() * 4) - 1)
            ]
            ref_w = quant_layout.dequantize(qw, sc, zp, (n, k), group, 4).float()
            for m in (2, 4):
                x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                t_bf16 = do_bench_cudagraph(_cycle([lambda d=d, x=x: x @ d.t() for d in dense]), rep=30)
                ref = x.float() @ ref_w.t()
                for zeros in (False, True) if group == 32 else (False,):
                    calls = [(x, p[0], p[1], p[2] if zeros else None, group, 4) for p in packs]
                    fn = _cycle([lambda a=a: K.quant_matmul(*a) for a in calls])
                    saved_max, qm.GEMV_MAX_M = qm.GEMV_MAX_M, 1  # the tensor-core kernel from 2 rows
                    tensor_core = do_bench_cudagraph(fn, rep=30)
                    saved_group, qm.GEMV_MAX_M, qm.GEMV_ROWS_MAX_GROUP = qm.GEMV_ROWS_MAX_GROUP, 4, 1 << 30
                    results = forced_gemv_tiles(fn, grid, (x, qw, sc, zp, group, 4) if zeros else None, ref)
                    default = do_bench_cudagraph(fn, rep=30)  # the FMA kernel at the shipped tuning
                    qm.GEMV_MAX_M, qm.GEMV_ROWS_MAX_GROUP = saved_max, saved_group
                    best = "; ".join(
                        f"{t * 1e3:.2f}us bn{bn} w{w} split{sp}" for t, bn, w, bk, sp in results[:4]
                    )
                    print(f"gemv-rows m={m} g={group} zp={zeros} k={k} n={n}: bf16 {t_bf16 * 1e3:.2f}us | "
                          f"tensor-core {tensor_core * 1e3:.2f}us | FMA at the shipped tuning "
                          f"{default * 1e3:.2f}us | FMA best {best}", flush=True)  # fmt: skip


def sweep_int8() -> None:
    """int8 weight-only (issue 16 asks >= 1.6x bf16 at <= 16 rows), groups of 128 (the bench's rows) and per
    channel (what compress writes), on the tensor-core kernel (int8's only decode kernel since an int8 FMA
    kernel lost to it: runs 8-9 of the log) at 1, 4 and 16 rows, each over a tile grid (best four and the
    shipped choice), with bf16's time."""
    grid = list(itertools.product((64, 128), (4, 8), (3,), (4, 8, 16)))
    for k, n in [(4096, 4096), (4096, 14336), (14336, 4096)]:
        weight = torch.randn(n, k, device="cuda", dtype=DTYPE) / 64
        dense = [weight] + [weight.clone() for _ in range(_copies(weight.numel() * 2) - 1)]
        for group in (128, k):
            t = quant_layout.pack_weight(weight, 8, group)
            qw, sc = t["weight_packed"], t["weight_scale"]
            packs = [(qw, sc)] + [(qw.clone(), sc.clone()) for _ in range(_copies(qw.numel() * 4) - 1)]
            for m in (1, 4, 16):
                x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                t_bf16 = do_bench_cudagraph(_cycle([lambda d=d, x=x: x @ d.t() for d in dense]), rep=30)
                fn = _cycle([lambda p=p, x=x, g=group: K.quant_matmul(x, *p, None, g, 8) for p in packs])
                line = tiles(lambda fn=fn: do_bench_cudagraph(fn, rep=30), grid)
                print(f"int8 g={group} m={m} k={k} n={n}: bf16 {t_bf16 * 1e3:.1f}us | {line}", flush=True)


if __name__ == "__main__":
    sweeps = {"--sweep", "--sweep-gemv", "--sweep-int8", "--sweep-gemv-narrow", "--sweep-gemv-rows"}
    if sweeps & set(sys.argv):
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
        if "--sweep-gemv-narrow" in sys.argv:
            sweep_gemv_narrow()
        elif "--sweep-gemv-rows" in sys.argv:
            sweep_gemv_rows()
        elif "--sweep" in sys.argv:
            sweep("--zp" in sys.argv)
        elif "--sweep-gemv" in sys.argv:
            sweep_gemv()
        else:
            sweep_int8()
    else:
        main()
