"""Issue 16 item 1: where the Gluon decode's time goes. Kernels that share its loading warp, their compute
warps doing more of its work step by step, against the kernel itself, a plain streaming read and cuBLAS bf16
(H100, cold weights in CUDA graphs as bench_quant_matmul.py times them).

    python tests/gpu/decode_stream_probe.py [--ms 8,16] [--tiles 16:4:p264:64:256:4,...] [--shapes 14336x4096]
        [--steps drain,kernel]

The stream-K decode (kernels/ops/quant_matmul_gluon.py) read 14336^2 int4 g128 at 16 rows in ~53 us, 2.0
TB/s, where Marlin takes ~46 (2.3 TB/s). The ladder's kernels share its loading warp (``_load_partition``:
the same run of (tile, K unit) pairs, the same TMA boxes and ring); their compute warps, per K tile
(``_ladder_partition``): ``drain`` wait for the stage and hand it back; ``words`` also read its words into
the operand's layout (folded into one value, so the reads stay); ``scales`` also load the scales three tiles
ahead; ``mma`` also run the products, on an operand made with one add a value pair; ``dequant`` make the
operand as the kernel does (the kernel less its writes); ``store`` plain stores of each run's part of a tile;
``atomics`` fp32 atomics in their place. Then ``kernel`` (quant_matmul's launch at the same tiling) and
``before`` (the same with ``late_first`` off: every part of a tile through the workspace, as before the
eighteenth session). ``read`` (plain vector loads, each program a contiguous run) is what this GPU streams
at all. ``owned`` and ``owned_atomics`` are steps 4 and 6 on thread-owned words (quant_layout.to_owned_order:
each thread of the operand reads only its own words and places a value pair with a shift and a lop3), after a
check of step 6's sums on both word orders against x @ dequantized W. Results: tests/benchmarks/NOTES.md,
"eighteenth session" and "nineteenth session".

A tiling is BLOCK_M:STAGES:pPROGRAMS:BLOCK_N:BLOCK_K:WARPS, or with a split in place of pPROGRAMS
(gluon_prefill_probe.py's form); the ladder's steps are stream-K only.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.testing import do_bench_cudagraph

import squeezeserve.kernels as K
from squeezeserve.kernels import quant_layout
from squeezeserve.kernels.ops import quant_matmul as qm
from squeezeserve.kernels.ops import quant_matmul_gluon as qg

sys.path.insert(0, str(Path(__file__).parent))
from gluon_prefill_probe import COLD_BYTES, cycle, packed, tiling  # noqa: E402 (this folder)

SHAPES = [(14336, 14336), (14336, 4096), (28672, 4096), (4096, 14336), (4096, 4096)]
STEPS = ["drain", "words", "scales", "mma", "dequant", "store", "atomics"]  # the ladder's, in order
EXTRA = ["owned", "owned_atomics", "kernel", "before"]  # steps 4 and 6 on owned words; the kernel now, before
TILES = ["16:4:p264:64:256:4", "16:6:p264:64:256:4", "16:4:p396:64:256:4", "16:8:p132:64:256:4",
         "16:4:p132:128:256:8", "16:6:p264:64:128:4", "16:8:p264:64:128:4"]  # fmt: skip


@gluon.jit
def _plain_operand(w_smem, select, dtype: gl.constexpr, w_layout: gl.constexpr, a_layout: gl.constexpr,
                   BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
    """quant_matmul_gluon._operand with one integer add a value pair in place of its dequantization: the
    words read and laid out as the operand, at the least arithmetic."""
    h = w_smem.load(gl.SliceLayout(2, w_layout))
    h, select = gl.broadcast(gl.expand_dims(h, 2), select)
    pairs = gl.reshape(h + select, [BLOCK_N, BLOCK_K // 2])
    halves = gl.join(pairs.to(gl.int16), (pairs >> 16).to(gl.int16))
    w = gl.reshape(halves, [BLOCK_N, BLOCK_K]).to(dtype, bitcast=True)
    return gl.convert_layout(w, a_layout, assert_trivial=True)


@gluon.jit
def _ladder_partition(
    x_smem,
    w_smem,
    ready,
    empty,
    scale_ptr,
    out_ptr,
    y_ptr,
    M,
    N,
    K,
    scale_row_stride,
    STEP: gl.constexpr,
    OWNED: gl.constexpr,
    GROUP: gl.constexpr,
    MAGIC_F: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The compute warps' loop of ``_compute_partition`` (same run, same order of waits, hand-backs and
    loads), doing a part of its work per K tile as STEP says: 0 none (wait for the stage, hand it back), 1
    read its words into the operand's layout (folded, so the reads stay), 2 also load the scales three tiles
    ahead (folded too), 3 also run the products, on an operand made from the words with one add a value pair
    (:func:`_plain_operand`), 4 make the operand as the kernel does (the kernel less its writes of the
    sums), 5 store each run's part of a tile in fp32 ``y`` (plain stores: wrong sums, the stores' cost), 6 add
    it into ``y`` with fp32 atomics (the kernel's atomics without its count, fence and read-back). ``OWNED``:
    the words are thread-owned (quant_layout.to_owned_order), read as the kernel reads them then."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    w_layout: gl.constexpr = qg._word_layout(BLOCK_N, BLOCK_K, num_warps, OWNED)
    rows_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, w_layout))
    dtype: gl.constexpr = x_smem.dtype
    p = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, w_layout)))
    if OWNED:
        select = gl.expand_dims(gl.expand_dims(4 * p, 0), 1)  # [1, 1, 4]: pair j's shift
    else:
        select = gl.expand_dims(gl.expand_dims(p + 0x4440, 0), 1)
    start, end, k_units = qg._share(M, N, K, 0, True, BLOCK_M, BLOCK_N, BLOCK_K)
    tiles_m = gl.cdiv(M, BLOCK_M)
    fold = gl.zeros([BLOCK_N, BLOCK_K // 8], gl.int32, gl.SliceLayout(2, w_layout))
    pfold = gl.zeros([BLOCK_N], gl.int32, rows_layout)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma_layout)
    g = 0
    unit = start
    while unit < end:
        tile, u0, units, off_m, off_n = qg._segment(unit, end, k_units, tiles_m, BLOCK_M, BLOCK_N)
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=rows_layout)
        mask_n = offs_n < N
        first = 2 * u0
        n_local = 2 * units
        if STEP >= 2:
            params0 = qg._load_params(scale_ptr, scale_ptr, offs_n, mask_n, first, K, scale_row_stride, 0,
                                      GROUP, False, MAGIC_F, BLOCK_K, num_warps)  # fmt: skip
            params1 = qg._load_params(scale_ptr, scale_ptr, offs_n, mask_n, first + 1, K, scale_row_stride, 0,
                                      GROUP, False, MAGIC_F, BLOCK_K, num_warps)  # fmt: skip
            params2 = qg._load_params(scale_ptr, scale_ptr, offs_n, mask_n, first + 2, K, scale_row_stride, 0,
                                      GROUP, False, MAGIC_F, BLOCK_K, num_warps)  # fmt: skip
        mbarrier.wait(ready.index(g % STAGES), (g // STAGES) & 1)
        if STEP >= 4:
            a0 = qg._operand(w_smem.index(g % STAGES), params0, select, dtype, w_layout, a_layout, GROUP,
                             BLOCK_N, BLOCK_K, num_warps, OWNED)  # fmt: skip
        elif STEP == 3:
            a0 = _plain_operand(w_smem.index(g % STAGES), select, dtype, w_layout, a_layout, BLOCK_N, BLOCK_K)
        else:
            a0 = gl.zeros([BLOCK_N, BLOCK_K], dtype, a_layout)
        a1 = a0
        for i in range(0, n_local, 2):
            for j in gl.static_range(2):
                t = g + i + j
                if STEP >= 3:
                    acc = warpgroup_mma(a0, x_smem.index(t % STAGES).permute((1, 0)), acc, is_async=True)
                    acc, a1 = warpgroup_mma_wait(num_outstanding=1, deps=[acc, a1])
                mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), pred=i + j > 0)
                if STEP >= 2:
                    params3 = qg._load_params(scale_ptr, scale_ptr, offs_n, mask_n, first + i + j + 3, K,
                                              scale_row_stride, 0, GROUP, False, MAGIC_F, BLOCK_K,
                                              num_warps)  # fmt: skip
                nxt = (t + 1) % STAGES
                mbarrier.wait(ready.index(nxt), ((t + 1) // STAGES) & 1, pred=i + j + 1 < n_local)
                if STEP >= 4:
                    a_next = qg._operand(w_smem.index(nxt), params1, select, dtype, w_layout, a_layout, GROUP,
                                         BLOCK_N, BLOCK_K, num_warps, OWNED)  # fmt: skip
                elif STEP == 3:
                    a_next = _plain_operand(w_smem.index(nxt), select, dtype, w_layout, a_layout, BLOCK_N,
                                            BLOCK_K)  # fmt: skip
                else:
                    a_next = gl.zeros([BLOCK_N, BLOCK_K], dtype, a_layout)
                    if STEP >= 1:
                        fold = fold ^ w_smem.index(nxt).load(gl.SliceLayout(2, w_layout))
                if STEP == 2 or STEP == 3:
                    pfold = pfold ^ (params1[0] + params1[2]).to(gl.int16, bitcast=True).to(gl.int32)
                if STEP >= 2:
                    params1, params2 = params2, params3
                a1 = a0
                a0 = a_next
        if STEP >= 3:
            acc, a0, a1 = warpgroup_mma_wait(num_outstanding=0, deps=[acc, a0, a1])
        g += n_local
        mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES))
        if STEP == 5:
            qg._write(acc, y_ptr, y_ptr, y_ptr, tile, True, False, units, k_units, off_m, off_n, M, N, N, 0,
                      BLOCK_M, BLOCK_N, num_warps)  # fmt: skip
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma_layout)
        if STEP == 6:
            qg._write(acc, y_ptr, y_ptr, y_ptr, tile, False, False, units, k_units, off_m, off_n, M, N, N, 1,
                      BLOCK_M, BLOCK_N, num_warps)  # fmt: skip
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma_layout)
        unit += units
    total = gl.sum(gl.sum(fold, axis=1), axis=0) + gl.sum(pfold, axis=0)
    total += gl.sum(gl.sum(acc, axis=1), axis=0).to(gl.int32)
    gl.store(out_ptr + gl.program_id(0), total)


@gluon.jit
def _ladder_kernel(
    x_desc,
    w_desc,
    scale_ptr,
    out_ptr,
    y_ptr,
    M,
    N,
    K,
    scale_row_stride,
    STEP: gl.constexpr,
    OWNED: gl.constexpr,
    GROUP: gl.constexpr,
    MAGIC_F: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    x_smem, w_smem, ready, empty = qg._ring(x_desc, w_desc, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)
    gl.warp_specialize(
        [
            (_ladder_partition, (x_smem, w_smem, ready, empty, scale_ptr, out_ptr, y_ptr, M, N, K,
                                 scale_row_stride, STEP, OWNED, GROUP, MAGIC_F, BLOCK_M, BLOCK_N, BLOCK_K,
                                 STAGES, num_warps)),
            (qg._load_partition, (x_desc, w_desc, x_smem, w_smem, ready, empty, M, N, K, 0, True, BLOCK_M,
                                  BLOCK_N, BLOCK_K, STAGES)),
        ],
        [1],
        [24],
    )  # fmt: skip


def ladder_args(x2, qweight, scales, group, out, y, step, block_m, block_n, block_k, stages, num_warps,
                programs, occupancy=1, owned_words=False, **_):  # fmt: skip
    """The grid, arguments and keywords of the ladder's ``step`` over this weight at this tiling (one int32
    a program into ``out``), registers capped for ``occupancy`` programs an SM as
    quant_matmul_gluon.launch_args caps them; ``owned_words``: ``qweight`` is in the thread-owned order."""
    m, k_in = x2.shape
    x_desc = TensorDescriptor.from_tensor(x2, [block_m, block_k], qg._smem_layout(block_m, block_k, x2.dtype))
    w_desc = TensorDescriptor.from_tensor(
        qweight, [block_n, block_k // 8], qg._smem_layout(block_n, block_k // 8)
    )
    k_units = math.ceil(math.ceil(k_in / block_k) / 2)
    tiles = math.ceil(m / block_m) * math.ceil(qweight.shape[0] / block_n)
    grid = (min(programs, tiles * k_units),)
    args = (x_desc, w_desc, scales, out, y, m, qweight.shape[0], k_in, scales.stride(0))
    kwargs = {"STEP": step, "OWNED": owned_words, "GROUP": group, "MAGIC_F": 128.0, "BLOCK_M": block_m,
              "BLOCK_N": block_n, "BLOCK_K": block_k, "STAGES": stages, "num_warps": num_warps,
              "maxnreg": min(255, 65536 // occupancy // (32 * (num_warps + 4))) // 8 * 8}  # fmt: skip
    return grid, args, kwargs


def ladder(*args, **kw):
    """The ladder's step (:func:`ladder_args`) launched."""
    grid, a, kwargs = ladder_args(*args, **kw)
    _ladder_kernel[grid](*a, **kwargs)


@triton.jit
def _read_kernel(src_ptr, out_ptr, n_words, per_program, BLOCK: tl.constexpr):
    """Program p folds words [p * per_program, (p + 1) * per_program) of ``src``: a plain streaming read."""
    start = tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], tl.int32)
    for off in range(0, per_program, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + idx, mask=idx < n_words, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def read(qweight, out, programs=264, block=4096):
    n_words = qweight.numel()
    per = math.ceil(n_words / programs / block) * block
    _read_kernel[(math.ceil(n_words / per),)](qweight, out, n_words, per, BLOCK=block, num_warps=8)


LAYER = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # 8B


def layer(ms, group):
    """The 8B model's four decode GEMMs through quant_matmul, as this session ships them and with the rules
    and meeting before it (the Gluon decode from 2 rows of 2^27 values and 17 of 2^25, every part of a tile
    through the workspace), one run: the layer's sum at each row count."""
    ship = (qm.GLUON_DECODE_MIN_WEIGHT, qm.GLUON_DECODE_WIDER_MIN_M, qm.gluon_decode_tiles)
    old = (1 << 27, qm.SKINNY_MAX_M + 1, lambda m, sms: ship[2](m, sms) | {"late_first": False})
    for m in ms:
        sums = {"now": 0.0, "before": 0.0}
        row = []
        for name, (n, k) in LAYER.items():
            qw, sc, _, _ = packed(n, k, group, False)
            copies = max(1, min(64, math.ceil(COLD_BYTES / (qw.numel() * 4))))
            packs = [(qw, sc)] + [(qw.clone(), sc.clone()) for _ in range(copies - 1)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            fn = cycle([lambda c=c, x=x: K.quant_matmul(x, c[0], c[1], None, group, 4) for c in packs])
            for label, rules in (("now", ship), ("before", old)):
                qm.GLUON_DECODE_MIN_WEIGHT, qm.GLUON_DECODE_WIDER_MIN_M, qm.gluon_decode_tiles = rules
                t = do_bench_cudagraph(fn, rep=40) * 1e3
                sums[label] += t
                row.append(f"{name} {label} {t:.1f}us")
            qm.GLUON_DECODE_MIN_WEIGHT, qm.GLUON_DECODE_WIDER_MIN_M, qm.gluon_decode_tiles = ship
        print(
            f"layer m={m} g={group}: now {sums['now']:.1f}us, before {sums['before']:.1f}us | "
            + ", ".join(row)
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ms", default="16", help="rows of x, comma-separated")
    p.add_argument("--tiles", default=",".join(TILES))
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="N x K, comma-separated")
    p.add_argument("--group", type=int, default=128)
    p.add_argument(
        "--steps",
        default=",".join(STEPS + ["kernel", "before"]),
        help="what to time, of " + ", ".join(STEPS + EXTRA),
    )
    p.add_argument("--layer", action="store_true", help="the 8B layer's four GEMMs, now and before (layer())")
    args = p.parse_args()
    if args.layer:
        layer([int(v) for v in args.ms.split(",")], args.group)
        return
    tiles = [(spec, tiling(spec)) for spec in args.tiles.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for (n, k), m in itertools.product(shapes, [int(v) for v in args.ms.split(",")]):
        qw, sc, zp, dense = packed(n, k, args.group, False)
        nbytes = qw.numel() * 4 + sc.numel() * sc.element_size()
        copies = max(1, min(64, math.ceil(COLD_BYTES / (qw.numel() * 4))))
        packs = [(qw, sc)] + [(qw.clone(), sc.clone()) for _ in range(copies - 1)]
        if any(name.startswith("owned") for name in args.steps.split(",")):
            packs = [(c[0], c[1], quant_layout.to_owned_order(c[0])) for c in packs]
        dcopies = max(1, min(64, math.ceil(COLD_BYTES / (dense.numel() * 2))))
        denses = [dense] + [dense.clone() for _ in range(dcopies - 1)]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1024, device="cuda", dtype=torch.int32)
        y = torch.zeros(m, n, device="cuda", dtype=torch.float32)

        def rate(t, b=nbytes):
            return f"{t * 1e3:.1f}us {b / t / 1e9:.2f}TB/s"

        t_bf16 = do_bench_cudagraph(cycle([lambda d=d, x=x: x @ d.t() for d in denses]), rep=40)
        t_read = do_bench_cudagraph(cycle([lambda c=c, o=out: read(c[0], o) for c in packs]), rep=40)
        row = [f"bf16 {rate(t_bf16, dense.numel() * 2)}", f"read {rate(t_read, qw.numel() * 4)}"]
        for spec, kw in tiles:
            if not qg.supported(x, qw, sc, args.group, 4, kw["block_k"]):
                continue
            if "owned_atomics" in args.steps.split(","):  # the sums on owned words, against the dense product
                want = x.float() @ dense.float().t()
                for label, words, own in (("words", qw, False), ("owned words", packs[0][2], True)):
                    y.zero_()
                    ladder(x, words, sc, args.group, out, y, 6, owned_words=own, **kw)
                    err = ((y - want).abs().max() / want.abs().max()).item()
                    print(f"check m={m} n={n} k={k} {spec} {label}: rel err {err:.2e}", flush=True)
                    assert err < 2e-3, "the ladder's sums are wrong"
            got = []
            steps = [
                (
                    name,
                    lambda c, kw=kw, x=x, o=out, y=y, s=step: ladder(
                        x, c[0], c[1], args.group, o, y, s, **kw
                    ),
                )
                for step, name in enumerate(STEPS)
            ]
            # (quant_matmul's own launch of the kernel: parts of tiles meet in the workspace)
            # the kernel less its writes, then with atomics, on thread-owned words
            for name, step in (("owned", 4), ("owned_atomics", 6)):
                steps.append((name, lambda c, kw=kw, x=x, o=out, y=y, s=step: ladder(
                    x, c[2], c[1], args.group, o, y, s, owned_words=True, **kw)))  # fmt: skip
            steps.append(("kernel", lambda c, kw=kw, x=x: qm._gluon(x, c[0], c[1], None, args.group, kw)))
            before = kw | {"late_first": False}  # (every part adds to the workspace: before the 18th session)
            steps.append(("before", lambda c, kw=before, x=x: qm._gluon(x, c[0], c[1], None, args.group, kw)))
            for name, fn in [(name, fn) for name, fn in steps if name in args.steps.split(",")]:
                try:
                    t = do_bench_cudagraph(cycle([functools.partial(fn, c) for c in packs]), rep=40)
                    got.append(f"{name} {rate(t)}")
                except Exception as exc:  # (a tiling that does not fit: say so, go on)
                    got.append(f"{name} {type(exc).__name__}: {str(exc)[:80]}")
            row.append(f"{spec}: " + ", ".join(got))
        print(f"m={m} n={n} k={k} g={args.group} ({nbytes / 1e6:.1f} MB): " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
