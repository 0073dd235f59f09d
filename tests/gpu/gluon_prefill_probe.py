"""Issue 16 items 1 and 2: the Gluon GEMM (kernels/ops/quant_matmul_gluon.py: the stream-K decode up to 64
rows, the prefill GEMM past that) against cuBLAS bf16, the paths before it (the tensor-core decode kernel,
the Triton GEMM or dequantize + cuBLAS), the Gluon kernel forced at quant_matmul's tiling, and
quant_matmul's auto choice. Correctness first (every tiling, tails, groups, zero points, fp16), then GPU
time of cold weights in CUDA graphs, as bench_quant_matmul.py times them.

    python tests/gpu/gluon_prefill_probe.py [--check-only] [--ms 128,512] [--tiles 128:4:1,256:4:p132] \\
        [--machete]

``--machete`` adds vLLM's Machete W4A16 GEMM (what vLLM runs for compressed-tensors W4A16 on an H100; vLLM
staged) on the same weights, re-quantized to its symmetric format, beside each row.

A tiling is BLOCK_M:STAGES:SPLIT[:BLOCK_N[:BLOCK_K[:WARPS]]][:c][:r][:t]; SPLIT ``pN`` shares the work among N
programs (stream-K, N // 132 an SM) instead of splitting each tile's K; ``c``: clusters of two programs
sharing x's tiles (``launch_args``' ``cluster``); a last ``r``: each warpgroup frees its own ring stages
(``launch_args``' ``wg_release``); a last ``t``: each tile's sum goes out by a TMA store (``tma_store``);
``pNwW`` first runs W waves of whole tiles a program (``launch_args``'
``dp_waves``: a negative W, all the full waves but -W), then shares the rest; ``PN``: N programs each taking
a wave's tile whole at a time (``launch_args``' ``persistent``); a number SPLIT ``SoO``: K split S ways with
registers capped for O programs an SM (``launch_args``' ``occupancy``; e.g. ``1o2``, a tile a program, two
an SM).
Tilings run through ``prefill()`` (parts of tiles meet in a zeroed fp32 output, then a cast: slower than
quant_matmul's workspace at many rows).
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

import squeezeserve.kernels as K
from squeezeserve.kernels import quant_layout
from squeezeserve.kernels.ops import quant_matmul as qm
from squeezeserve.kernels.ops import quant_matmul_gluon as qg

# The 8B model's four GEMMs (N, K): qkv_proj, o_proj, gate_up, down; and 14336^2.
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (14336, 14336)]
COLD_BYTES = 256 * 2**20


def packed(n, k, group, zeros, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    weight = torch.randn(n, k, device="cuda", dtype=dtype) / 64
    t = quant_layout.pack_weight(weight, 4, group, symmetric=not zeros)
    qw, sc = t["weight_packed"], t["weight_scale"].to(dtype)
    zp = t.get("weight_zero_point")
    dense = quant_layout.dequantize(qw, sc, zp, (n, k), group, 4).to(dtype)
    return qw, sc, zp, dense


def check():
    bf, fp = torch.bfloat16, torch.float16
    deep = {"block_n": 64, "block_k": 256, "num_warps": 4}  # one warpgroup, 256-deep K tiles (decode)
    cases = [  # (m, n, k, group, zeros, dtype, tiling)
        (128, 4096, 4096, 128, False, bf, {}),
        (200, 4160, 4096, 128, True, bf, {}),  # M and N tails
        (77, 1024, 4160, 32, True, bf, {"block_m": 64, "stages": 3}),  # K tail, odd tile count
        (512, 2048, 2048, 32, False, bf, {"block_m": 256}),
        (384, 4096, 4096, 32, True, bf, {"block_n": 256, "stages": 3}),  # 256 weight rows a program
        (256, 2048, 2048, 64, True, fp, {}),
        (300, 2048, 14336, 128, True, bf, {"block_m": 256, "stages": 3}),
        (128, 4096, 4096, 256, False, bf, {}),
        (130, 1024, 4128, 32, True, bf, {}),  # K tail inside a tile
        (300, 2048, 4160, 128, True, bf, {"block_m": 256, "split": 3}),  # K split, odd tail
        (512, 2304, 4160, 128, False, bf, {"block_m": 256, "programs": 132}),  # stream-K
        (16, 14336, 4096, 128, False, bf, {"block_m": 16, "block_k": 256, "programs": 132}),
        (5, 4160, 4160, 128, True, bf, {"block_m": 8, "block_k": 256, "programs": 100}),
        (64, 4096, 14336, 32, True, bf, {"block_m": 64, "stages": 8, "programs": 132}),
        (33, 4096, 4096, 64, True, fp, {"block_m": 64, "block_n": 64, "num_warps": 4, "programs": 99}),
        # four and eight groups a 256-deep tile (each row's group parameters in one vector load)
        (16, 14336, 4096, 32, True, bf, {"block_m": 16, "programs": 132} | deep),
        (5, 4160, 3840, 64, True, fp, {"block_m": 8, "programs": 100} | deep),  # odd K tiles, N tail
        (64, 4096, 14336, 32, False, bf, {"block_m": 64, "block_k": 256, "stages": 3, "programs": 132}),
        (1, 2048, 2048, 128, False, bf, {"block_m": 8, "block_k": 256, "programs": 8}),  # whole tiles
        (
            16,
            4096,
            4096,
            128,
            True,
            bf,
            {"block_m": 16, "block_n": 64, "num_warps": 4, "programs": 264, "occupancy": 2, "block_k": 256},
        ),  # fmt: skip
        (77, 1024, 4160, 32, True, fp, {"block_m": 64, "stages": 6, "programs": 50}),
    ]
    worst = 0.0
    for m, n, k, group, zeros, dtype, tiling in cases:
        qw, sc, zp, dense = packed(n, k, group, zeros, dtype)
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        y = qg.prefill(x, qw, sc, zp, group, **tiling).float()
        torch.cuda.synchronize()
        ref = (x @ dense.t()).float()
        err = ((y - ref).norm() / ref.norm()).item()
        worst = max(worst, err)
        print(
            f"check m={m} n={n} k={k} g={group} zeros={zeros} {dtype} {tiling}: rel err {err:.2e}", flush=True
        )
        assert err < 2e-3, err
    print(f"check: all {len(cases)} cases within 2e-3 (worst {worst:.2e})")


def served_weights(n: int, k: int, group: int, zeros: bool, words: str = "served"):
    """A random int4 weight of N x K as the probes time it: (words, scales, zero points, the dequantized
    bf16 weight, whether the words are thread-owned), on the words the vLLM method serves it on
    (``vllm_ops.owned_shape``) or, ``words`` "packed" / "owned", all alike."""
    from squeezeserve.kernels import quant_layout, vllm_ops

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
    t = quant_layout.pack_weight(w, 4, group, symmetric=not zeros)
    qw, sc, zp = t["weight_packed"], t["weight_scale"].to(torch.bfloat16), t.get("weight_zero_point")
    dense = quant_layout.dequantize(qw, sc, zp, (n, k), group, 4).to(torch.bfloat16)
    owned = vllm_ops.owned_shape(n, k, group, zeros) if words == "served" else words == "owned"
    if owned:
        qw = quant_layout.to_owned_order(qw)
        zp = None if zp is None else quant_layout.to_owned_zeros(zp, n)
    return qw, sc, zp, dense, owned


def cold_copies(qw, sc, zp, dense):
    """Copies of a weight past the L2 (up to 64), cycled through by the timed calls: ([(words, scales, zero
    points), ...], [dense bf16 weight, ...])."""
    copies = max(1, min(64, math.ceil(COLD_BYTES / (qw.numel() * 4))))
    packs = [(qw, sc, zp)] + [
        (qw.clone(), sc.clone(), None if zp is None else zp.clone()) for _ in range(copies - 1)
    ]
    denses = [dense] + [
        dense.clone() for _ in range(max(1, min(64, math.ceil(COLD_BYTES / dense.nbytes))) - 1)
    ]
    return packs, denses


def tiling(spec: str) -> dict:
    """A tiling (the module doc) as prefill()'s keywords."""
    bm, stages, split, *rest = spec.split(":")
    store = rest[-1:] == ["t"]  # a last field ``t``: each tile's sum goes out by a TMA store (tma_store)
    rest = rest[:-1] if store else rest
    release = rest[-1:] == ["r"]  # ``r``: each warpgroup frees its own stages (wg_release)
    rest = rest[:-1] if release else rest
    cluster = rest[-1:] == ["c"]  # ``c``: clusters of two programs sharing x's tiles (launch_args' cluster)
    rest = rest[:-1] if cluster else rest
    bn, bk, warps = [int(v) for v in rest] + [128, 64, 8][len(rest) :]
    out = {"block_m": int(bm), "stages": int(stages), "block_n": bn, "block_k": bk, "num_warps": warps}
    out |= {"wg_release": True} if release else {}
    out |= {"cluster": 2} if cluster else {}
    out |= {"tma_store": True} if store else {}
    if split.startswith("P"):
        return out | {"programs": int(split[1:]), "persistent": True}
    if split.startswith("p"):
        programs, _, waves = split[1:].partition("w")
        dp = {"dp_waves": int(waves)} if waves else {}
        return out | {"programs": int(programs), "occupancy": max(1, int(programs) // 132)} | dp
    split, _, occupancy = split.partition("o")
    return out | {"split": int(split)} | ({"occupancy": int(occupancy)} if occupancy else {})


def machete(dense, group):
    """Callables x -> vLLM's Machete GEMM of ``dense`` re-quantized (symmetric, ``group``), one a copy."""
    from vllm import _custom_ops as ops

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from bench_quant_matmul import machete_pack

    wtype, b, w_s = machete_pack(dense, group)
    copies = [(b, w_s)] + [(b.clone(), w_s.clone()) for _ in range(math.ceil(COLD_BYTES / b.nbytes) - 1)]
    return [
        lambda x, c=c: ops.machete_mm(a=x, b_q=c[0], b_type=wtype, b_group_scales=c[1], b_group_size=group)
        for c in copies[:64]
    ]


def overlapped(x2, qweight, scales, zeros, k_in, group, slice_rows, side, buffers, events):
    """Dequantize + cuBLAS in slices with slice i+1 dequantized on ``side`` while slice i's product runs
    (two buffers): the trial behind ``--overlap``."""
    main = torch.cuda.current_stream()
    n_out = qweight.shape[0]
    y = x2.new_empty((x2.shape[0], n_out))
    side.wait_stream(main)
    for i, start in enumerate(range(0, n_out, slice_rows)):
        end = min(start + slice_rows, n_out)
        buf = buffers[i % 2][: end - start]
        z = zeros[start // 8 : (end + 7) // 8] if zeros is not None else None
        with torch.cuda.stream(side):
            if i >= 2:
                side.wait_event(events[i % 2][1])  # the product two slices back has read this buffer
            qm.dequantize(qweight[start:end], scales[start:end], z, k_in, group, 4, x2.dtype, buf)
            events[i % 2][0].record(side)
        main.wait_event(events[i % 2][0])
        torch.matmul(x2, buf.t(), out=y[:, start:end])
        events[i % 2][1].record(main)
    return y


def cycle(fns):
    it = itertools.cycle(fns)
    return lambda: next(it)()


def bench(ms, groups, tiles, zeros_too, with_machete=False, slices=(), overlap=()):
    for group, (n, k) in itertools.product(groups, SHAPES):
        for zeros in (False, True) if zeros_too else (False,):
            qw, sc, zp, dense = packed(n, k, group, zeros)
            copies = max(1, min(64, math.ceil(COLD_BYTES / (qw.numel() * 4))))
            packs = [(qw, sc, zp)] + [(qw.clone(), sc.clone(), zp) for _ in range(copies - 1)]
            dcopies = max(1, min(64, math.ceil(COLD_BYTES / (dense.numel() * 2))))
            denses = [dense] + [dense.clone() for _ in range(dcopies - 1)]
            peer = machete(dense, group) if with_machete and not zeros else []
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                t_bf16 = do_bench_cudagraph(cycle([lambda d=d, x=x: x @ d.t() for d in denses]), rep=40)
                ship = [lambda p=p, x=x, g=group: K.quant_matmul(x, p[0], p[1], p[2], g, 4) for p in packs]
                saved = qm.GLUON_PREFILL_MAX_M, qm.GLUON_PREFILL_MAX_M_SMALL_GROUP, qm.DECODE
                qm.GLUON_PREFILL_MAX_M = qm.GLUON_PREFILL_MAX_M_SMALL_GROUP = 0  # the paths before Gluon
                qm.DECODE = "triton"
                t_ship = do_bench_cudagraph(cycle(ship), rep=40)
                qm.PREFILL = qm.DECODE = "gluon"
                t_forced = do_bench_cudagraph(cycle(ship), rep=40)
                qm.GLUON_PREFILL_MAX_M, qm.GLUON_PREFILL_MAX_M_SMALL_GROUP, qm.DECODE = saved
                qm.PREFILL = "auto"
                t_auto = do_bench_cudagraph(cycle(ship), rep=40)
                row = []
                if peer:
                    t = do_bench_cudagraph(cycle([lambda f=f, x=x: f(x) for f in peer]), rep=40)
                    row.append(f"machete {t * 1e3:.1f}us {t_bf16 / t:.2f}x")
                for rows in slices:  # dequantize + cuBLAS a slice of W's rows at a time
                    fn = cycle(
                        [
                            lambda p=p, x=x, r=rows, k=k, g=group: qm.dequantize_matmul(x, *p, k, g, 4, r)
                            for p in packs
                        ]
                    )
                    t = do_bench_cudagraph(fn, rep=40)
                    row.append(f"slice {rows} {t * 1e3:.1f}us {t_bf16 / t:.2f}x")
                for rows in overlap:  # the same with the next slice dequantized on a side stream
                    side = torch.cuda.Stream()
                    bufs = [torch.empty(rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                    evs = [[torch.cuda.Event(), torch.cuda.Event()] for _ in range(2)]
                    fn = cycle(
                        [
                            lambda p=p, x=x, r=rows, k=k, g=group, s=side, b=bufs, e=evs: overlapped(
                                x, *p, k, g, r, s, b, e
                            )
                            for p in packs
                        ]
                    )
                    ref = x @ dense.t()
                    got = overlapped(x, *packs[0], k, group, rows, side, bufs, evs)
                    torch.cuda.synchronize()
                    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                    assert err < 1e-3, f"overlapped slices: rel err {err}"
                    t = do_bench_cudagraph(fn, rep=40)
                    row.append(f"overlap {rows} {t * 1e3:.1f}us {t_bf16 / t:.2f}x")
                for spec, kw in tiles:
                    bm = kw["block_m"]
                    if bm > 2 * max(m, 8) or 4 * bm < min(m, 256):
                        continue  # (tiles far taller or shorter than m)
                    if not qg.supported(x, qw, sc, group, 4, kw["block_k"]):
                        continue
                    fn = cycle([lambda p=p, x=x, g=group, kw=kw: qg.prefill(x, *p, g, **kw) for p in packs])
                    try:
                        t = do_bench_cudagraph(fn, rep=40)
                    except Exception as exc:
                        row.append(f"{spec} {type(exc).__name__}")
                        continue
                    flops = 2 * m * n * k / t / 1e9
                    row.append(f"{spec} {t * 1e3:.1f}us {t_bf16 / t:.2f}x {flops:.0f}TF")
                print(
                    f"m={m} n={n} k={k} g={group} zp={int(zeros)}: bf16 {t_bf16 * 1e3:.1f}us | shipped "
                    f"{t_ship * 1e3:.1f}us {t_bf16 / t_ship:.2f}x | forced {t_forced * 1e3:.1f}us "
                    f"{t_bf16 / t_forced:.2f}x | auto {t_auto * 1e3:.1f}us "
                    f"{t_bf16 / t_auto:.2f}x | " + "; ".join(row),
                    flush=True,
                )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--ms", default="128,256,512,2048,8192")
    p.add_argument("--groups", default="128,32")
    p.add_argument("--tiles", default="128:4:1,256:4:1", help="tilings (the module doc)")
    p.add_argument("--shapes", default="", help="N:K,... (default: the 8B model's and 14336^2)")
    p.add_argument("--zeros", action="store_true", help="also time asymmetric weights")
    p.add_argument("--machete", action="store_true", help="also time vLLM's Machete (module doc)")
    p.add_argument(
        "--slices", default="", help="also dequantize + cuBLAS this many rows of W at a time, e.g. 4096"
    )
    p.add_argument("--overlap", default="", help="also slices with the next dequantized on a side stream")
    a = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    check()
    if a.check_only:
        return
    tiles = [(t, tiling(t)) for t in a.tiles.split(",")] if a.tiles else []
    if a.shapes:
        SHAPES[:] = [tuple(int(v) for v in s.split(":")) for s in a.shapes.split(",")]
    bench(
        [int(v) for v in a.ms.split(",")],
        [int(g) for g in a.groups.split(",")],
        tiles,
        a.zeros,
        a.machete,
        [int(v) for v in a.slices.split(",") if v],
        [int(v) for v in a.overlap.split(",") if v],
    )


if __name__ == "__main__":
    main()
