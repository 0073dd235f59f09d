"""Weight-only int4/int8 quant_matmul vs bf16 torch.matmul at decode (M <= 64) and prefill shapes.

Decode timings replay CUDA graphs (one launch each, as vLLM serves them). Weights are cold: every timed
call reads a different copy, with enough copies that they exceed the 50 MB L2 (a decode step reads each
layer's weights once; timing one copy over and over would serve a 4096 x 4096 int4 weight from L2).

    python tests/benchmarks/bench_quant_matmul.py            # rows for results/kernels.csv
    python tests/benchmarks/bench_quant_matmul.py --sweep    # tile / split-K sweep of the skinny kernel
    python tests/benchmarks/bench_quant_matmul.py --marlin   # with vLLM's Marlin and Machete (vLLM staged)
    python tests/benchmarks/bench_quant_matmul.py --marlin --owned  # and int4 on thread-owned words
    python tests/benchmarks/bench_quant_matmul.py --marlin --owned --zeros  # only the zero-point rows
    python tests/benchmarks/bench_quant_matmul.py --marlin --owned --only 32  # only int4 g32
    python tests/benchmarks/bench_quant_matmul.py --marlin --only 32 --shapes 576:3072,1536:576  # bundled
    ncu -k regex:_gemv --launch-skip 2 -c 1 python tests/benchmarks/bench_quant_matmul.py --profile
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import Recorder, peaks  # noqa: E402
from peers import peer_weight  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

import squeezeserve.kernels as K  # noqa: E402
from squeezeserve.kernels import quant_layout  # noqa: E402
from squeezeserve.kernels.ops import quant_matmul as qm  # noqa: E402
from squeezeserve.kernels.ops import quant_matmul_kernels as qk  # noqa: E402

DTYPE = torch.bfloat16
KN = [(4096, 4096), (4096, 14336), (14336, 4096), (14336, 14336)]
COLD_BYTES = 256 * 2**20  # working set per timed function: 5x the H100's L2


def _copies(nbytes: int) -> int:
    return max(1, min(64, math.ceil(COLD_BYTES / nbytes)))


def _cycle(fns):
    """One callable that runs the next of ``fns`` on every call (captured in order into a CUDA graph)."""
    it = itertools.cycle(fns)
    return lambda: next(it)()


def _packed(n, k, bits, group, zeros=False):
    """(packed words, scales, packed zero points or None) of a random weight."""
    weight = torch.randn(n, k, device="cuda", dtype=DTYPE) / 64
    t = quant_layout.pack_weight(weight, bits, group, symmetric=not zeros)
    return t["weight_packed"], t["weight_scale"], t.get("weight_zero_point") if zeros else None


def run(
    rec, bits=4, group=128, ms_=(1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192), kn=KN, peers=(), owned=False,
    zeros=False,
):  # fmt: skip
    """``owned``: also time int4 quant_matmul_owned on the same weights in thread-owned order (what the vLLM
    method serves on Hopper). ``zeros``: asymmetric weights (packed zero points, as compress writes them;
    rows tagged ``-zp``)."""
    tag = f"int{bits}-g{group}" + ("-zp" if zeros else "")
    owned = owned and bits == 4
    for k, n in kn:
        qw, sc, zp = _packed(n, k, bits, group, zeros)
        w_bytes = qw.numel() * 4 + sc.numel() * 2 + (zp.numel() * 4 if zeros else 0)
        packs = [(qw, sc, zp)] + [
            (qw.clone(), sc.clone(), zp.clone() if zeros else None) for _ in range(_copies(w_bytes) - 1)
        ]
        dense = quant_layout.dequantize(qw, sc, zp, (n, k), group, bits).to(DTYPE)
        denses = [dense] + [dense.clone() for _ in range(_copies(dense.numel() * 2) - 1)]
        owned_packs = [
            (quant_layout.to_owned_order(q), s, quant_layout.to_owned_zeros(z, n) if zeros else None)
            for q, s, z in packs
        ] if owned else []  # fmt: skip
        for m in ms_:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            graph = True  # GPU time, one launch per call (decode steps and prefills alike)
            ours = _cycle([lambda p=p, x=x: K.quant_matmul(x, *p, group, bits) for p in packs])
            ref = _cycle([lambda d=d, x=x: x @ d.t() for d in denses])
            y, y_ref = K.quant_matmul(x, qw, sc, zp, group, bits).float(), (x @ dense.t()).float()
            err = ((y - y_ref).norm() / y_ref.norm()).item()
            assert err < 1e-2, f"quant_matmul mismatch {err} at {(m, n, k)}"
            shape = (m, n, k)
            io = 2 * m * (k + n)
            ours_name = f"squeezeserve-{tag}"
            t_ours = rec.time(ours_name, "fwd", shape, DTYPE, ours, nbytes=w_bytes + io, graph=graph)
            t_ref = rec.time("torch-bf16", "fwd", shape, DTYPE, ref, nbytes=n * k * 2 + io, graph=graph)
            if t_ours and t_ref:
                rec.add(f"squeezeserve-{tag}", "fwd", shape, DTYPE, "speedup_vs_bf16", [t_ref / t_ours], "x")
            if owned_packs:
                y_owned = qm.quant_matmul_owned(x, *owned_packs[0], group).float()
                err = ((y_owned - y_ref).norm() / y_ref.norm()).item()
                assert err < 1e-2, f"quant_matmul_owned mismatch {err} at {(m, n, k)}"
                fn = _cycle([lambda p=p, x=x: qm.quant_matmul_owned(x, *p, group) for p in owned_packs])
                name = f"{ours_name}-owned"
                t_own = rec.time(name, "fwd", shape, DTYPE, fn, nbytes=w_bytes + io, graph=graph)
                if t_own and t_ref:
                    rec.add(name, "fwd", shape, DTYPE, "speedup_vs_bf16", [t_ref / t_own], "x")
            for name, peer in peers if bits == 4 else ():
                t_p = peer(rec, m, n, k, group, x, dense, shape, w_bytes + io, zeros)
                if t_p and t_ref:
                    rec.add(f"vllm-{name}-{tag}", "fwd", shape, DTYPE, "speedup_vs_bf16", [t_ref / t_p], "x")


def sweep(kn=KN[:3], group=128, bits=4, ms=None):
    """Time the decode kernels under every tile / split-K / warps / stages setting; print the best
    per shape (it chose ``quant_matmul.tuning`` and ``GEMV_MAX_M``)."""
    saved = {name: getattr(qm, name) for name in ("tuning", "GEMV_MAX_M", "GEMV_ROWS_MAX_GROUP")}
    qm.GEMV_ROWS_MAX_GROUP = 1 << 30  # "gemv" rows on the FMA kernel at every group
    grid = list(itertools.product((64, 128), (4, 8), (3, 4), (4, 8, 16)))
    ms = ms or {"gemv": (1, 2), "mma": (4, 16, 64)}
    for k, n in kn:
        qw, sc, _ = _packed(n, k, bits, group)
        packs = [(qw, sc)] + [(qw.clone(), sc.clone()) for _ in range(_copies(qw.numel() * 4) - 1)]
        for kernel in ("gemv", "mma"):
            qm.GEMV_MAX_M = 64 if kernel == "gemv" else 0
            for m in ms[kernel]:
                x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                results = []
                for bn, warps, stages, split in grid:
                    cfg = {"BLOCK_N": bn, "split": split, "num_warps": warps, "num_stages": stages}
                    qm.tuning = lambda *a, cfg=cfg, **kw: cfg
                    fn = _cycle(
                        [lambda p=p, x=x: K.quant_matmul(x, p[0], p[1], None, group, bits) for p in packs]
                    )
                    try:
                        t = do_bench_cudagraph(fn, rep=20)
                    except Exception as exc:  # out of shared memory / registers for the largest tiles
                        print(f"# {kernel} {cfg}: {type(exc).__name__}", file=sys.stderr)
                        continue
                    finally:
                        qm.tuning = saved["tuning"]
                    results.append((t, bn, warps, stages, split))
                results.sort()
                default = saved["tuning"](kernel, m, n, k, 128, x.device)
                t_default = next((r[0] for r in results if r[1:] == (default["BLOCK_N"], default["num_warps"],
                                  default["num_stages"], default["split"])), float("nan"))  # fmt: skip
                print(f"sweep {kernel} m={m} n={n} k={k} g={group}: " + "; ".join(
                    f"{t * 1e3:.1f}us bn{bn} w{w} s{st} split{sp}" for t, bn, w, st, sp in results[:5])
                    + f" | default {default} {t_default * 1e3:.1f}us", flush=True)  # fmt: skip
    qm.GEMV_MAX_M, qm.GEMV_ROWS_MAX_GROUP = saved["GEMV_MAX_M"], saved["GEMV_ROWS_MAX_GROUP"]


PREFILL_MS = (128, 512, 2048, 8192)
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, split) of the prefill sweep. (The weight as the MMA's B operand
# and scales after the dot were swept too, on 2026-11-23, and were slower everywhere: NOTES.md.)
PREFILL_GRID = [
    (128, 128, 64, 4, 4, 1), (128, 128, 64, 8, 4, 1), (128, 128, 64, 8, 3, 1), (256, 128, 64, 8, 3, 1),
    (256, 128, 64, 8, 4, 1), (128, 256, 64, 8, 3, 1), (128, 64, 64, 4, 4, 1), (128, 64, 64, 4, 3, 1),
    (64, 128, 64, 4, 4, 1), (128, 128, 128, 8, 3, 1), (128, 64, 128, 4, 3, 1), (64, 64, 64, 4, 4, 1),
    (64, 64, 64, 4, 4, 2), (256, 64, 64, 4, 3, 1),
]  # fmt: skip
# --split-grid: the leading tilings above with K splits, for grids that fill the SMs unevenly (ncu,
# results/ncu_h100_2026-11-25/: 224 programs of one an SM are 1.70 waves on the H100's 132 SMs)
PREFILL_SPLIT_GRID = [
    (bm, bn, bk, w, st, sp)
    for bm, bn, bk, w, st in (
        (256, 128, 64, 8, 4),
        (256, 64, 64, 4, 3),
        (128, 128, 128, 8, 3),
        (64, 64, 64, 4, 4),
    )
    for sp in (1, 2, 3, 4, 7)
]


def prefill_sweep(kn=KN, groups=(128,), bits=4, ms=PREFILL_MS, grid=PREFILL_GRID):
    """Time the prefill GEMM under every PREFILL_GRID setting beside bf16 cuBLAS and dequantize + cuBLAS;
    print the best per shape (it chose ``quant_matmul.prefill_tuning``)."""
    saved = qm.prefill_tuning
    for group in groups:
        for k, n in kn:
            qw, sc, _ = _packed(n, k, bits, group)
            packs = [(qw, sc)] + [(qw.clone(), sc.clone()) for _ in range(_copies(qw.numel() * 4) - 1)]
            dense = quant_layout.dequantize(qw, sc, None, (n, k), group, bits).to(DTYPE)
            denses = [dense] + [dense.clone() for _ in range(_copies(dense.numel() * 2) - 1)]
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=DTYPE)
                t_bf16 = do_bench_cudagraph(_cycle([lambda d=d, x=x: x @ d.t() for d in denses]), rep=30)
                ours = _cycle([lambda p=p, x=x, g=group: K.quant_matmul(x, p[0], p[1], None, g, bits)
                               for p in packs])  # fmt: skip
                qm.PREFILL = "dequantize"
                t_deq = do_bench_cudagraph(ours, rep=30)
                qm.PREFILL = "triton"
                results = []
                for bm, bn, bk, warps, stages, split in grid:
                    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "split": split, "num_warps": warps,
                           "num_stages": stages, "SWIZZLE": 8}  # fmt: skip
                    qm.prefill_tuning = lambda *a, cfg=cfg: cfg
                    try:
                        y = K.quant_matmul(x, qw, sc, None, group, bits).float()
                        ref = (x @ dense.t()).float()
                        err = ((y - ref).norm() / ref.norm()).item()
                        t = do_bench_cudagraph(ours, rep=30)
                    except Exception as exc:  # out of shared memory / registers for the largest tiles
                        print(f"# prefill {cfg}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
                        continue
                    finally:
                        qm.prefill_tuning = saved
                    results.append((t, err, bm, bn, bk, warps, stages, split))
                qm.PREFILL = "auto"
                t_auto = do_bench_cudagraph(ours, rep=30)
                results.sort()
                print(f"prefill m={m} n={n} k={k} g={group}: bf16 {t_bf16 * 1e3:.1f}us dequant+cublas "
                      f"{t_deq * 1e3:.1f}us ({t_bf16 / t_deq:.2f}x) auto {t_auto * 1e3:.1f}us "
                      f"({t_bf16 / t_auto:.2f}x) | " + "; ".join(
                      f"{t * 1e3:.1f}us {t_bf16 / t:.2f}x m{bm} n{bn} k{bk} w{w} s{st} sp{sp} err{e:.1e}"
                      for t, e, bm, bn, bk, w, st, sp in results[:6]), flush=True)  # fmt: skip


def profile(n=14336, k=14336, group=128, bits=4):
    """Plain (not graph) calls of the decode kernels at 1 and 16 rows, for Nsight Compute to profile."""
    qw, sc, _ = _packed(n, k, bits, group)
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda", dtype=DTYPE)
        for _ in range(5):
            K.quant_matmul(x, qw, sc, None, group, bits)
    torch.cuda.synchronize()


def dump(out: Path, group=128, bits=4):
    """Write the Triton IR and PTX of the decode kernels at 4096 x 4096 (what the compiler made of them)."""
    out.mkdir(parents=True, exist_ok=True)
    k = n = 4096
    qw, sc, _ = _packed(n, k, bits, group)
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda", dtype=DTYPE)
        K.quant_matmul(x, qw, sc, None, group, bits)
    for name in ("_gemv_int4_kernel", "_skinny_kernel"):
        kernel = getattr(qk, name)
        for device_cache in kernel.device_caches.values():
            for i, compiled in enumerate(device_cache[0].values()):
                for ir in ("ttgir", "ptx"):
                    (out / f"{name}-{i}.{ir}").write_text(str(compiled.asm.get(ir, "")))


def marlin_pack(dense: torch.Tensor, group: int, zeros: bool):
    """``dense`` [N, K] re-quantized for vLLM's Marlin W4A16 GEMM: (type, q_w, s, zp, g_idx, sort_idx), the
    symmetric weight as GPTQ's uint4b8, with zero points as uint4 and Marlin's zero points (AWQ's Marlin
    path). Needs vLLM."""
    from vllm.model_executor.layers.quantization.utils import marlin_utils as mu
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import (
        awq_marlin_quantize,
        marlin_quantize,
    )
    from vllm.scalar_type import scalar_types

    wtype = scalar_types.uint4 if zeros else scalar_types.uint4b8
    empty = mu.marlin_make_empty_g_idx(dense.device)
    if zeros:
        _, q_w, s, zp = awq_marlin_quantize(dense.t().contiguous(), wtype, group)
        return wtype, q_w, s, zp, empty, empty
    _, q_w, s, g_idx, sort_idx, _ = marlin_quantize(dense.t().contiguous(), wtype, group, False)
    return wtype, q_w, s, empty, g_idx, sort_idx


def marlin_timer():
    """A timer for vLLM's Marlin W4A16 GEMM on the same (re-quantized) weights, or None without vLLM."""
    try:
        from vllm.model_executor.layers.quantization.utils import marlin_utils as mu
    except Exception as exc:
        print(f"# marlin unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    packed = {}

    def pack(dense, group, zeros):
        wtype, q_w, s, zp, g_idx, sort_idx = marlin_pack(dense, group, zeros)
        copies = [(q_w, s, zp)] + [
            (q_w.clone(), s.clone(), zp.clone()) for _ in range(_copies(q_w.numel() * 4) - 1)
        ]
        return copies, g_idx, sort_idx, wtype

    def timer(rec, m, n, k, group, x, dense, shape, nbytes, zeros=False):
        tag = f"g{group}" + ("-zp" if zeros else "")
        weight = peer_weight(
            packed, (n, k, group, zeros), lambda: pack(dense, group, zeros), f"vllm-marlin-int4-{tag}"
        )
        if weight is None:
            return None
        copies, g_idx, sort_idx, wtype = weight
        ws = mu.marlin_make_workspace_new(x.device)
        fn = _cycle([
            lambda c=c: mu.apply_gptq_marlin_linear(x, *c, g_idx, sort_idx, ws, wtype, n, k, True)
            for c in copies
        ])  # fmt: skip
        # (a row count Marlin refuses at call time, "Invalid thread config", is recorded as such by rec.time)
        return rec.time(f"vllm-marlin-int4-{tag}", "fwd", shape, DTYPE, fn, nbytes=nbytes, graph=True)

    return timer


def machete_pack(dense: torch.Tensor, group: int):
    """``dense`` [N, K] re-quantized for vLLM's Machete W4A16 GEMM (symmetric, uint4b8): (type, the
    prepacked weight, its group scales). Needs vLLM."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.quant_utils import pack_rows, quantize_weights
    from vllm.scalar_type import scalar_types

    n, k = dense.shape
    wtype = scalar_types.uint4b8
    _, w_q, w_s, _ = quantize_weights(dense.t().contiguous(), wtype, group)
    w_q = pack_rows(w_q, 4, k, n).t().contiguous().t()
    return wtype, ops.machete_prepack_B(w_q, dense.dtype, wtype, dense.dtype), w_s


def machete_timer():
    """A timer for vLLM's Machete W4A16 GEMM (Hopper's mixed-input CUTLASS kernel, what vLLM picks for
    compressed-tensors W4A16 on an H100) on the same re-quantized weights, or None without vLLM."""
    try:
        from vllm import _custom_ops as ops
        from vllm.scalar_type import scalar_types
    except Exception as exc:
        print(f"# machete unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    wtype = scalar_types.uint4b8
    packed = {}

    def pack(dense, group):
        _, b, w_s = machete_pack(dense, group)
        return [(b, w_s)] + [(b.clone(), w_s.clone()) for _ in range(_copies(b.numel() * 4) - 1)]

    def timer(rec, m, n, k, group, x, dense, shape, nbytes, zeros=False):
        if zeros:  # (the symmetric kernel only: Marlin is item 1's peer for zero points)
            return None
        copies = peer_weight(packed, (n, k, group), lambda: pack(dense, group), f"vllm-machete-int4-g{group}")
        if copies is None:
            return None
        fn = _cycle([
            lambda c=c, x=x: ops.machete_mm(a=x, b_q=c[0], b_type=wtype, b_group_scales=c[1],
                                            b_group_size=group)
            for c in copies
        ])  # fmt: skip
        return rec.time(f"vllm-machete-int4-g{group}", "fwd", shape, DTYPE, fn, nbytes=nbytes, graph=True)

    return timer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--marlin", action="store_true")
    parser.add_argument("--owned", action="store_true", help="also time int4 on thread-owned words")
    parser.add_argument("--zeros", action="store_true", help="only the asymmetric (zero point) runs")
    parser.add_argument("--only", help="only int4 of these groups, e.g. 32: with and without zero points")
    parser.add_argument("--dump", type=Path, help="write the decode kernels' Triton IR and PTX here")
    parser.add_argument("--profile", action="store_true", help="a few plain calls for ncu, nothing timed")
    parser.add_argument(
        "--shapes", help="only these K:N pairs (--sweep, --prefill-sweep, --only), e.g. 576:1536"
    )
    parser.add_argument("--prefill-sweep", action="store_true", help="tile sweep of the prefill GEMM")
    parser.add_argument("--groups", default="128", help="groups of --prefill-sweep, e.g. 128,32")
    parser.add_argument("--ms", help="row counts of --prefill-sweep, e.g. 128,2048")
    parser.add_argument("--split-grid", action="store_true", help="--prefill-sweep over PREFILL_SPLIT_GRID")
    args = parser.parse_args()
    shapes = [tuple(map(int, p.split(":"))) for p in args.shapes.split(",")] if args.shapes else None
    peaks()
    if args.dump:
        try:
            dump(args.dump)
        except Exception as exc:  # Triton's cache layout differs between versions; the dump is a diagnostic
            print(f"# dump failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    if args.profile:
        profile()
        sys.exit(0)
    if args.sweep:
        kn = shapes or KN[:3]
        sweep(kn)
    if args.prefill_sweep:
        kn = shapes or KN
        ms = tuple(map(int, args.ms.split(","))) if args.ms else PREFILL_MS
        grid = PREFILL_SPLIT_GRID if args.split_grid else PREFILL_GRID
        prefill_sweep(kn, groups=tuple(map(int, args.groups.split(","))), ms=ms, grid=grid)
    if args.dump or args.sweep or args.prefill_sweep:
        sys.exit(0)
    recorder = Recorder("quant_matmul")
    peers = [(name, t) for name, t in (("marlin", marlin_timer()), ("machete", machete_timer()))
             if t is not None] if args.marlin else []  # fmt: skip
    wide = [(4096, 14336), (14336, 4096)]
    if args.only:
        kn = shapes or wide
        for group in map(int, args.only.split(",")):
            for zeros in (False, True):
                run(recorder, bits=4, group=group, ms_=(1, 2, 4, 8, 16, 32, 64, 512), kn=kn, peers=peers,
                    owned=args.owned, zeros=zeros)  # fmt: skip
        recorder.write()
        sys.exit(0)
    if not args.zeros:
        run(recorder, peers=peers, owned=args.owned)
        run(recorder, bits=4, group=32, ms_=(1, 4, 16, 64, 512, 2048), kn=wide, peers=peers, owned=args.owned)
        run(recorder, bits=4, group=64, ms_=(1, 16), kn=[(4096, 14336)])
        run(recorder, bits=8, group=128, ms_=(1, 4, 16, 2048), kn=wide)
    for group in (32, 128):  # asymmetric, as compress writes int4 (item 1 of issue 16: against Marlin's)
        run(recorder, bits=4, group=group, ms_=(1, 2, 4, 8, 16, 32, 64, 512), kn=wide, peers=peers,
            owned=args.owned, zeros=True)  # fmt: skip
    recorder.write()
