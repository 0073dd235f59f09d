"""An int4 x bf16/fp16 GEMM on Hopper in Gluon whose dequantization overlaps its tensor-core work: the
prefill GEMM from 129 rows, and a stream-K decode GEMM up to 64.

Why a second prefill kernel. ``_prefill_kernel`` (Triton) dequantizes each K tile of the weight into the
registers of the wgmma's A operand, then waits for the tile's products before it may write the next tile's
operand (``_after_mma``): dequantization and the tensor cores take turns. Nsight Compute on the H100 put
its tensor pipe at 39-61% against cuBLAS bf16's 80-95% (tests/benchmarks/NOTES.md, 2026-11-25), and
Triton 3.6 offers no way to reorder that wait. Gluon (``triton.experimental.gluon``) states the schedule
explicitly:

- activations and the weight's packed int32 words stream in through TMA into a ring of ``STAGES``
  shared-memory stages, issued by one loading warp of its own (``gl.warp_specialize``): it waits on each
  stage's ``empty`` barrier, the compute warps wait on its ``ready`` barrier, and neither stops for the
  other's bookkeeping (issuing the loads from the compute warps took four CTA barriers a K tile; warp
  specialisation made decode 3-6% and prefill 2-6% faster on the H100). The scales and zero points, too
  small for TMA, come by plain loads three tiles ahead;
- each warpgroup issues tile t's products asynchronously (``warpgroup_mma(..., is_async=True)``), then
  dequantizes tile t + 1 into fresh registers while they run, and only then waits for tile t - 1's
  products (``warpgroup_mma_wait(1)``), whose operand registers it names as ``deps`` so that they stay
  untouched until then: the race ``_after_mma`` guards against cannot arise. Two tiles an iteration keep
  consecutive operands in distinct registers (a loop-carried operand rewritten in place made ptxas run
  every product synchronously);
- each thread reads from shared memory the words whose value pairs its A fragment holds (``_word_layout``),
  and each pair becomes one fragment register (``_PAIR_ASM``): no data movement between the words and the
  operand (``convert_layout(..., assert_trivial=True)`` proves it when the kernel compiles).

Where K is deep, prefill runs in clusters of two programs with neighbouring weight tiles and the same rows
of x (``launch_args``' ``cluster``): each loads half of each x tile into both programs' stages, and a stage
is free once both are done with it (TMA multicast and remote releases, which Gluon in Triton 3.6 cannot say:
a pass over the kernel's PTX, :mod:`ptx_cluster`), halving the L2-to-SM bytes of x
(quant_matmul.GLUON_CLUSTER). Where K is shallower the clustered programs are persistent (``launch_args``'
``persistent``: one an SM, a wave's tile at a time), so that each loading warp fills its next tile's stages
while the compute warps write the last tile, through shared memory by a TMA store they do not wait for
(``tma_store``; quant_matmul.GLUON_PERSISTENT).

Launched as a programmatic dependent (``launch_args``' ``pdl``), the kernel lets the next one launch, sends
its first stages' weight words before it waits for the kernel before it, then loads x: the decode's start
overlaps the previous kernel's end where that kernel triggers its dependents (quant_matmul.PDL_MAX_M says
where quant_matmul launches it so; NOTES.md, twenty-fourth and twenty-fifth sessions).

Work is counted in (output tile, K unit) pairs, a unit two K tiles. Each program takes one tile's share of
K (``split`` ways), or, stream-K, an equal run of all the pairs, in order, which may hold the end of one
tile and the start of the next: then parts of a tile meet in fp32 (atomics into y, or the self-cleaning
workspace, where the part that completes the tile's count of units stores it). quant_matmul runs decode
stream-K, one or two programs an SM, so that every SM streams the same share of the weight whatever the
tile count (a 14336-wide output in tiles of 64 weight rows: 224 tiles over 132 SMs); prefill a tile a program,
unless the tiles fill under half the SMs (the parts' meeting costs more than a partial wave).

The product is computed transposed, ``acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile.T``: the weight is the
wgmma's A operand (from registers; 64 weight rows a warpgroup) and the activations its B operand (from
shared memory), so 8..256 activation rows are one instruction's N.

Each weight is ``(q - z) * s`` rounded once in the activation dtype (``sub`` then ``mul`` on bf16x2/f16x2
pairs), as ``_dequantize_kernel`` writes it: the product equals dequantize + cuBLAS up to accumulation order.
Scope (:func:`supported`): int4, scales in the activation dtype, groups that hold whole K tiles (64 deep;
256 in decode) or half of one, or a quarter or an eighth of one where K is whole tiles (g64 / g32 in decode's
256-deep tiles: each row's group parameters of a tile come as one vector, :func:`_load_params`), K a
multiple of 32 (TMA's 16-byte rows), with or without zero points; sm_90 only. Speeds and the history of
this design: tests/benchmarks/NOTES.md, "tenth session", "eleventh session" and "thirteenth session".
"""

from __future__ import annotations

import functools
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from squeezeserve.kernels.ops import ptx_cluster, ptx_release
from squeezeserve.kernels.ops.launch import FastLaunch, capturing, cdiv, specialization_key

# Gluon's names in Triton 3.6 (vLLM 0.26's) and from 3.9 on: a CTA-wide barrier (``thread_barrier`` ->
# ``barrier``), a TMA load into shared memory (``async_copy_global_to_shared`` -> ``async_load``).
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _launch_dependents():
    """``griddepcontrol.launch_dependents``: the kernel after this one, launched as a programmatic dependent,
    may start once every program of this one has said so (or ended)."""
    gl.inline_asm_elementwise(
        "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _grid_dependency_wait():
    """``griddepcontrol.wait``: under programmatic dependent launch (PDL), until the kernel before this one
    in the stream has finished and its writes are visible; a no-op otherwise."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


_MARK_ASM = gl.constexpr(f"mov.u32 $0, 0; // {ptx_release.MARK}")


@gluon.jit
def _mark_release():
    """Asks :mod:`ptx_release`'s pass to have each warpgroup free its own stages (RELEASES > 1)."""
    gl.inline_asm_elementwise(_MARK_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


_CLUSTER_START_ASM = gl.constexpr(
    f"fence.mbarrier_init.release.cluster; barrier.cluster.arrive.release; barrier.cluster.wait.acquire; "
    f"mov.u32 $0, 0; // {ptx_cluster.MARK}"
)


@gluon.jit
def _cluster_start():
    """The compute warps' part of the cluster's start: the ring's barriers, just made, become visible to the
    other program, and they wait for both programs' (the loading warpgroup's arrival is ptx_cluster's, which
    this call's mark asks for, with TMA's multicast of x and the releases of the other program's stages)."""
    gl.inline_asm_elementwise(_CLUSTER_START_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


_CLUSTER_WAIT_ASM = gl.constexpr("barrier.cluster.wait.acquire; mov.u32 $0, 0;")


@gluon.jit
def _cluster_wait():
    """The loading warp's wait for the cluster's start (its arrival is ptx_cluster's, where the loading
    warpgroup leaves the compute warps): both programs' barriers are made."""
    gl.inline_asm_elementwise(_CLUSTER_WAIT_ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global  # (3.6: the latter)

# Value pair (2 j, 2 j + 1) of a word as one bf16x2 / f16x2 register, minus (BIAS + z), times s: the pair's
# byte alone (prmt; selector 0x4440 + j), copied 12 bits up (x 4097: bits 0-7 and 12-19), so that its low
# nibble lands at bit 0 and its high one at bit 16, the rest of the bits BIAS's, taken from $3 (one lop3:
# BIAS + z's bits above its nibble are BIAS's; with BIAS as an immediate the lop3 had two, which ptxas met
# with a register it rewrote before uses under the zero points' register pressure: NOTES.md, twenty-second
# session). $1 word, $2 prmt selector, $3 (BIAS + z) x2, $4 s x2. From a thread-owned word (quant_layout's
# to_owned_order), where pair j is nibbles j and j + 4, a shift by 4 j ($2) puts them at bits 0 and 16 in
# place of the first two instructions.
_PAIR_ASM = """{{
.reg .b32 b, p;
{place}
lop3.b32 p, p, 0x000F000F, $3, 0xE2;
sub.rn.{ty} p, p, $3;
mul.rn.{ty} $0, p, $4;
}}"""
_PACKED_PLACE = "prmt.b32 b, $1, 0, $2;\nmul.lo.u32 p, b, 4097;"
_OWNED_PLACE = "shr.b32 p, $1, $2;"
_PAIR_BF16 = gl.constexpr(_PAIR_ASM.format(place=_PACKED_PLACE, ty="bf16x2"))
_PAIR_F16 = gl.constexpr(_PAIR_ASM.format(place=_PACKED_PLACE, ty="f16x2"))
_OWNED_BF16 = gl.constexpr(_PAIR_ASM.format(place=_OWNED_PLACE, ty="bf16x2"))
_OWNED_F16 = gl.constexpr(_PAIR_ASM.format(place=_OWNED_PLACE, ty="f16x2"))


@gluon.constexpr_function
def _word_layout(block_n, block_k, num_warps, owned=False):
    """The [block_n, block_k // 8, 4] layout of (row, word, value pair) that becomes the wgmma A operand's
    fragment once each pair (one int32: two 16-bit values) splits into its halves and the last two dims
    merge into K: lane l holds pair l % 4 of words 2 s and 2 s + 1 of every 16-deep slice s, of rows l // 4
    and l // 4 + 8 of its warp's 16; warps stack along the rows. Its slice along the pairs is where each
    thread loads a word: the four lanes that share a word read it together. ``owned``
    (quant_layout.to_owned_order): lane l holds word 4 b + l % 4 of every 32-deep block b and all four of its
    pairs, its registers in the same order once the pairs are put in K order (:func:`_operand`)."""
    block_n, block_k, num_warps = int(block_n), int(block_k), int(num_warps)
    if owned:
        blocks = [[0, 4 << i, 0] for i in range(int(math.log2(block_k // 32)))]
        reg = [[8, 0, 0], [0, 0, 1], [0, 0, 2]] + blocks
        lane = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    else:
        reg = [[8, 0, 0], [0, 1, 0]] + [[0, 2 << i, 0] for i in range(int(math.log2(block_k // 16)))]
        lane = [[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    rows = 16 * num_warps
    while rows < block_n:
        reg.append([rows, 0, 0])
        rows *= 2
    warp = [[16 << i, 0, 0] for i in range(int(math.log2(num_warps)))]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [block_n, block_k // 8, 4])


@gluon.jit
def _load_params(
    scale_ptr,
    zero_ptr,
    offs_n,
    mask_n,
    tile,
    K,
    scale_row_stride,
    zero_row_stride,
    GROUP: gl.constexpr,
    HAS_ZERO: gl.constexpr,
    ZERO_ROWS: gl.constexpr,
    SCALES_TMA: gl.constexpr,
    MAGIC_F: gl.constexpr,
    BLOCK_K: gl.constexpr,
    num_warps: gl.constexpr,
):
    """(s, BIAS + z) [BLOCK_N] of the first and the last group of K tile ``tile`` (one group when groups
    hold whole tiles; two when a tile holds two groups). Four or more groups a tile: (s, BIAS + z)
    [BLOCK_N, groups], each row's scales in one vector load. s in the activation dtype, BIAS + z as its 16
    bits (:func:`_bias`); :func:`_operand` makes them value pairs where it uses them, so that the scales of
    the tiles loaded ahead stay two a register. With ``ZERO_ROWS`` and four or more groups, the zero points
    are a row's word of nibbles as loaded (:func:`_row_zeros`), made pairs in :func:`_operand` too. With
    ``SCALES_TMA`` the scales come with the words, by TMA (:func:`_load_partition`): here a placeholder."""
    if BLOCK_K >= 4 * GROUP:
        # (in _group_layout: a row's scales (and zero-point words) are contiguous, one vector load a row)
        G: gl.constexpr = BLOCK_K // GROUP
        layout: gl.constexpr = _group_layout(offs_n.shape[0], G, num_warps)
        row = gl.convert_layout(offs_n, gl.SliceLayout(1, layout), assert_trivial=True)
        rows = gl.expand_dims(row, 1)
        groups = gl.expand_dims(tile * G + gl.arange(0, G, layout=gl.SliceLayout(0, layout)), 0)
        # (K is a whole number of tiles here, supported(): a tile is all in or all out, the pad tile of an odd
        # count out, so the mask is a row's and its groups load as one vector)
        row_ok = gl.convert_layout(mask_n, gl.SliceLayout(1, layout), assert_trivial=True)
        row_ok = row_ok & (tile * BLOCK_K < K)
        ok = gl.expand_dims(row_ok, 1)
        if SCALES_TMA:
            s = gl.zeros([offs_n.shape[0], G], scale_ptr.dtype.element_ty, layout)
        else:
            s = gl.load(scale_ptr + rows.to(gl.int64) * scale_row_stride + groups, mask=ok, other=0.0)
        if HAS_ZERO and ZERO_ROWS:  # a row's G zero points: G nibbles, one load, as they are
            params = (s, _row_zeros(zero_ptr, row, row_ok, tile * G, zero_row_stride, G))
        else:
            if HAS_ZERO:
                zw = gl.load(zero_ptr + (rows // 8) * zero_row_stride + groups, mask=ok, other=0)
                z = (zw >> ((rows % 8) * 4)) & 0xF
            else:
                z = gl.zeros_like(rows + groups) + 8
            params = (s, _bias(z, MAGIC_F))  # 16-bit values: _operand makes them pairs, as it uses them
    else:
        g0 = (tile * BLOCK_K) // GROUP
        g1 = (tile * BLOCK_K + BLOCK_K - 1) // GROUP
        s0, z0 = _group_params(scale_ptr, zero_ptr, offs_n, mask_n, g0, K, scale_row_stride, zero_row_stride,
                               GROUP, HAS_ZERO and not ZERO_ROWS, MAGIC_F)  # fmt: skip
        if BLOCK_K > GROUP:
            s1, z1 = _group_params(scale_ptr, zero_ptr, offs_n, mask_n, g1, K, scale_row_stride,
                                   zero_row_stride, GROUP, HAS_ZERO and not ZERO_ROWS, MAGIC_F)  # fmt: skip
        else:
            s1, z1 = s0, z0
        if HAS_ZERO and ZERO_ROWS:  # the tile's one or two groups' zero points, a byte a row (g0 even if two)
            ok = mask_n & (g0 < gl.cdiv(K, GROUP))
            z = _row_zeros(zero_ptr, offs_n, ok, g0, zero_row_stride, 2 if BLOCK_K > GROUP else 1)
            z0 = _bias(z & 0xF, MAGIC_F)
            z1 = _bias((z >> 4) & 0xF, MAGIC_F) if BLOCK_K > GROUP else z0
        params = (s0, z0, s1, z1)
    return params


@gluon.constexpr_function
def _group_layout(block_n, groups, num_warps):
    """The [block_n, groups] layout of a K tile's per-row group parameters when a tile holds four or more
    groups: rows over lanes and warps as :func:`_word_layout` spreads the operand's words (the four lanes of
    a row alike), a row's groups in consecutive registers of each thread that holds the row (so that they
    load as one vector)."""
    block_n, groups, num_warps = int(block_n), int(groups), int(num_warps)
    reg = [[0, 1 << i] for i in range(int(math.log2(groups)))] + [[8, 0]]
    rows = 16 * num_warps
    while rows < block_n:
        reg.append([rows, 0])
        rows *= 2
    lane = [[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]]
    warp = [[16 << i, 0] for i in range(int(math.log2(num_warps)))]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [block_n, groups])


@gluon.jit
def _group_params(
    scale_ptr,
    zero_ptr,
    offs_n,
    mask_n,
    g,
    K,
    scale_row_stride,
    zero_row_stride,
    GROUP: gl.constexpr,
    HAS_ZERO: gl.constexpr,
    MAGIC_F: gl.constexpr,
):
    """(s, BIAS + z) [BLOCK_N] of group ``g``, zero points as compressed-tensors packs them (eight rows a
    word); without them (or where the caller loads them, :func:`_row_zeros`) the symmetric z."""
    ok = mask_n & (g < gl.cdiv(K, GROUP))
    s = gl.load(scale_ptr + offs_n.to(gl.int64) * scale_row_stride + g, mask=ok, other=0.0)
    if HAS_ZERO:
        zw = gl.load(zero_ptr + (offs_n // 8) * zero_row_stride + g, mask=ok, other=0)
        z = (zw >> ((offs_n % 8) * 4)) & 0xF
    else:
        z = gl.zeros_like(offs_n) + 8
    return s, _bias(z, MAGIC_F)


@gluon.jit
def _row_zeros(zero_ptr, row, ok, first, zero_row_stride, COUNT: gl.constexpr):
    """Zero points as quant_layout.to_owned_zeros lays them out (word j of a row holds its groups 8 j ..
    8 j + 7): groups first .. first + COUNT - 1 of each row as the low 4 COUNT bits of an int32 (first a
    multiple of COUNT), one load of their size (a byte for two groups, 16 bits for four, the word for eight:
    no shift by the tile's place in the word)."""
    if COUNT == 8:
        z = gl.load(zero_ptr + row * zero_row_stride + first // 8, mask=ok, other=0)
    elif COUNT == 4:
        at = zero_ptr.to(gl.pointer_type(gl.int16), bitcast=True) + row * (2 * zero_row_stride) + first // 4
        z = gl.load(at, mask=ok, other=0).to(gl.int32)
    else:
        at = zero_ptr.to(gl.pointer_type(gl.uint8), bitcast=True) + row * (4 * zero_row_stride) + first // 2
        z = gl.load(at, mask=ok, other=0).to(gl.int32)
        if COUNT == 1:
            z = z >> ((first % 2) * 4)
    return z


@gluon.jit
def _bias(z, MAGIC_F: gl.constexpr):
    """BIAS + z (z < 16) as the 16 bits of a bf16 / fp16 value: BIAS's bits with z in the low nibble (BIAS's
    unit is 1), one lop3 with the nibble's mask (a conversion through fp32 took three instructions)."""
    bits: gl.constexpr = 0x4300 if MAGIC_F == 128.0 else 0x6400
    return (z | bits).to(gl.int16)


@gluon.jit
def _twice(v):
    """A 16-bit value as both halves of an int32 (a bf16x2 / f16x2 register): one PRMT. (Written in integer
    arithmetic, :func:`_twice_arith`, it took two or three instructions a scale, which at eight groups a
    tile made g32's K loop 9% longer than g128's; tests/benchmarks/NOTES.md, twenty-first session.)"""
    return gl.inline_asm_elementwise(
        "mov.b32 $0, {$1, $1};", "=r,h", [v.to(gl.int16, bitcast=True)], dtype=gl.int32, is_pure=True, pack=1
    )


@gluon.jit
def _twice_arith(v):
    """:func:`_twice` in integer arithmetic, which ptxas schedules freely: the zero points' pairs at eight
    groups a tile (from :func:`_twice`'s PRMT the g32 decode with zero points spilled more, 12 against 4
    registers at 16 rows under Triton 3.6)."""
    return (v.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF) * 0x10001


@gluon.jit
def _stage_scales(s_smem, stage, BLOCK_N: gl.constexpr, G: gl.constexpr, num_warps: gl.constexpr):
    """A K tile's scales [BLOCK_N, 8] from its ring stage (SCALES_TMA), in :func:`_load_params`' layout."""
    return s_smem.index(stage).load(_group_layout(BLOCK_N, G, num_warps))


@gluon.jit
def _bytes(v, selector: gl.constexpr):
    """The bytes of ``v`` that ``selector`` names, one prmt (0x1010: the low half in both halves)."""
    return gl.inline_asm_elementwise(
        f"prmt.b32 $0, $1, 0, {selector};", "=r,r", [v], dtype=gl.int32, is_pure=True, pack=1
    )


@gluon.jit
def _nibble_pairs(v, biased):
    """The low nibble of each half of ``v`` under the rest of ``biased``'s bits (BIAS's, as in any BIAS + z
    pair): one lop3 with one immediate. (Written as ``& 0x000F000F | BIAS``, two immediates, ptxas kept the
    mask in a register it rewrote before most uses: 24 more instructions a K loop at g32.)"""
    return gl.inline_asm_elementwise(
        "lop3.b32 $0, $1, 0x000F000F, $2, 0xE2;", "=r,r,r", [v, biased], dtype=gl.int32, is_pure=True, pack=1
    )


@gluon.jit
def _operand(
    w_smem,
    params,
    select,
    dtype: gl.constexpr,
    w_layout: gl.constexpr,
    a_layout: gl.constexpr,
    GROUP: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    num_warps: gl.constexpr,
    OWNED: gl.constexpr,
    ZERO_ROWS: gl.constexpr,
):
    """A K tile's words in shared memory -> its [BLOCK_N, BLOCK_K] A operand in ``a_layout``, in registers:
    each thread reads the words its fragment needs and keeps one value pair of each, which is one fragment
    register after the (q + BIAS - (BIAS + z)) * s of :data:`_PAIR_ASM`. ``OWNED``: each thread reads its own
    words and takes all four pairs of each (:data:`_PAIR_ASM` with ``_OWNED_PLACE``); ``select`` is then each
    pair's shift."""
    W: gl.constexpr = BLOCK_K // 8
    h = w_smem.load(gl.SliceLayout(2, w_layout))  # [BLOCK_N, W]
    words = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(2, w_layout)))
    if BLOCK_K >= 4 * GROUP:
        # Four or more groups a tile: word w takes group w // (GROUP / 8)'s pair. A thread holds every word
        # and group of its rows in registers, so each select below is decided when the kernel compiles.
        G: gl.constexpr = BLOCK_K // GROUP
        rows_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, w_layout))
        s2 = _twice(params[0])
        if ZERO_ROWS:  # the tile's zero points as one word a row
            zrow = gl.convert_layout(params[1], rows_layout, assert_trivial=True)
            # each half word's four nibbles in both halves: pair j is then one shift and one lop3 off
            zdup = (_bytes(zrow, 0x1010), _bytes(zrow, 0x3232))
            biases: gl.constexpr = 0x43004300 if dtype == gl.bfloat16 else 0x64006400
            z_first = (zdup[0] & 0x000F000F) | biases
        else:
            z2 = _twice_arith(params[1])
        column = gl.expand_dims(
            gl.arange(0, G, layout=gl.SliceLayout(0, _group_layout(BLOCK_N, G, num_warps))), 0
        )
        group_of = gl.expand_dims(words // (GROUP // 8), 0)
        s = gl.zeros([BLOCK_N, W], gl.int32, gl.SliceLayout(2, w_layout))
        z = gl.zeros([BLOCK_N, W], gl.int32, gl.SliceLayout(2, w_layout))
        for j in gl.static_range(G):
            sj = gl.convert_layout(
                gl.sum(gl.where(column == j, s2, 0), axis=1), rows_layout, assert_trivial=True
            )
            if ZERO_ROWS:
                if j == 0:
                    zj = z_first
                else:
                    zj = _nibble_pairs(zdup[j // 4] >> (4 * (j % 4)), z_first)
            else:
                zj = gl.convert_layout(
                    gl.sum(gl.where(column == j, z2, 0), axis=1), rows_layout, assert_trivial=True
                )
            s = gl.where(group_of == j, gl.expand_dims(sj, 1), s)
            z = gl.where(group_of == j, gl.expand_dims(zj, 1), z)
    else:
        s0, z0, s1, z1 = params
        s = gl.expand_dims(_twice(s0), 1)
        z = gl.expand_dims(_twice(z0), 1)
        if BLOCK_K > GROUP:  # two groups a tile: the second half of the words takes the second's
            later = gl.expand_dims(words >= W // 2, 0)
            s = gl.where(later, gl.expand_dims(_twice(s1), 1), s)
            z = gl.where(later, gl.expand_dims(_twice(z1), 1), z)
    h, select = gl.broadcast(gl.expand_dims(h, 2), select)
    s, _ = gl.broadcast(gl.expand_dims(s, 2), select)
    z, _ = gl.broadcast(gl.expand_dims(z, 2), select)
    if OWNED and dtype == gl.bfloat16:
        asm: gl.constexpr = _OWNED_BF16
    elif OWNED:
        asm: gl.constexpr = _OWNED_F16
    elif dtype == gl.bfloat16:
        asm: gl.constexpr = _PAIR_BF16
    else:
        asm: gl.constexpr = _PAIR_F16
    pairs = gl.inline_asm_elementwise(
        asm, "=r,r,r,r,r", [h, select, z, s], dtype=gl.int32, is_pure=True, pack=1
    )
    if OWNED:  # (row, block b, lane's word p, pair j) holds K pair 16 b + 4 j + p: into K order
        pairs = gl.permute(gl.reshape(pairs, [BLOCK_N, BLOCK_K // 32, 4, 4]), (0, 1, 3, 2))
    pairs = gl.reshape(pairs, [BLOCK_N, BLOCK_K // 2])
    halves = gl.join(pairs.to(gl.int16), (pairs >> 16).to(gl.int16))
    w = gl.reshape(halves, [BLOCK_N, BLOCK_K]).to(dtype, bitcast=True)
    return gl.convert_layout(w, a_layout, assert_trivial=True)


@gluon.jit
def _write(
    acc,
    y_desc,
    y_smem,
    y_ptr,
    ws_ptr,
    count_ptr,
    tile,
    whole,
    late,
    units,
    k_units,
    off_m,
    off_n,
    M,
    N,
    y_row_stride,
    MODE: gl.constexpr,
    TMA_STORE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Store a tile's products (``whole``: all of K), or add a part of them (``units`` of the tile's
    ``k_units``) to the tile's sum as MODE says: 1, fp32 atomics into y (zero beforehand); 2, into the
    workspace, where the part that completes the count stores the sum in y and leaves the workspace and the
    count zero (as ``_write_tile``'s MODE 2).

    MODE 2, ``late`` (a part likely to be its tile's last: see the caller): first read the count; where the
    other parts have all added theirs (each adds its sum to the workspace before its units to the count),
    this part adds the workspace's sum to its own in registers and stores the tile, without adding its own
    to the workspace and the count. That spares the last part a round trip to L2 (the fence that waits for
    its atomics, then the count's), which ends the kernel's critical path (tests/gpu/decode_stream_probe.py:
    NOTES.md, "eighteenth session"). Where they have not, it adds its part as every part does.

    ``TMA_STORE`` (MODE 0): the tile goes into ``y_smem`` as y's tile and out by a TMA store (which clips
    rows and columns past y's end), which the compute warps do not wait for; the next tile's write, and the
    program's end, wait until it has read ``y_smem``."""
    if TMA_STORE:  # (MODE 0) into shared memory as y's tile, then TMA's store: the compute warps go on
        tma.store_wait(0)  # (the last tile's store has read y_smem)
        y_smem.permute((1, 0)).store(acc.to(y_ptr.dtype.element_ty))
        fence_async_shared()
        _cta_barrier()
        _tma_store(y_desc, [off_m, off_n], y_smem)
        return
    out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, num_warps], [0, 1])
    rows_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))
    rows_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout))
    at = gl.expand_dims(rows_m.to(gl.int64) * y_row_stride, 0) + gl.expand_dims(rows_n, 1)
    mask = gl.expand_dims(rows_n < N, 1) & gl.expand_dims(rows_m < M, 0)
    if MODE == 0:  # (every tile whole: cast first, so that the change of layout, through shared memory, moves
        # half the bytes; the same values. Nsight Compute, 2048 x 28672 x 4096 persistent: the epilogue in
        # fp32 was 6.1% of all warps' stall samples, the tensor pipe idle meanwhile)
        gl.store(y_ptr + at, gl.convert_layout(acc.to(y_ptr.dtype.element_ty), out_layout), mask=mask)
        return
    out = gl.convert_layout(acc, out_layout)
    if whole:
        gl.store(y_ptr + at, out.to(y_ptr.dtype.element_ty), mask=mask)
    elif MODE == 1:
        gl.atomic_add(y_ptr + at, out, mask=mask, sem="relaxed")
    elif MODE == 2:
        zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, out_layout)
        others = -units  # (not the others' count: the usual way below)
        if late:
            others = gl.atomic_add(count_ptr + tile, 0, sem="acquire")
        if others + units == k_units:  # every other part's sum is in the workspace
            _cta_barrier()
            total = gl.load(ws_ptr + at, mask=mask, other=0.0, cache_modifier=".cg") + out  # (at L2)
            gl.store(y_ptr + at, total.to(y_ptr.dtype.element_ty), mask=mask)
            gl.store(ws_ptr + at, zero, mask=mask)
            gl.store(count_ptr + tile, 0)
        else:
            gl.atomic_add(ws_ptr + at, out, mask=mask, sem="relaxed")
            _cta_barrier()  # every thread's partial is in before the (releasing) count below
            if gl.atomic_add(count_ptr + tile, units, sem="acq_rel") + units == k_units:
                _cta_barrier()
                total = gl.atomic_add(ws_ptr + at, zero, mask=mask, sem="relaxed")  # strong reads, at L2
                gl.store(y_ptr + at, total.to(y_ptr.dtype.element_ty), mask=mask)
                gl.store(ws_ptr + at, zero, mask=mask)
                gl.store(count_ptr + tile, 0)


@gluon.jit
def _share(
    M,
    N,
    K,
    units_per_split,
    dp_tiles,
    STREAM_K: gl.constexpr,
    DP: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
):
    """This program's run [start, end) of the (output tile, K unit) pairs, a unit two K tiles (a unit past
    K's last tile is zeros), tiles ordered so that programs sharing a weight tile run together: stream-K,
    program p of P takes [p U / P, (p + 1) U / P) of the U pairs of the tiles past the first ``dp_tiles``
    (those go whole, a wave at a time, first), parts of one or more tiles; else program (t, s) takes split s
    of tile t. Also how many stretches of pairs the program runs (:func:`_stretch`)."""
    k_units = gl.cdiv(gl.cdiv(K, BLOCK_K), 2)
    if STREAM_K:
        tiles = gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        if DP:
            tiles -= dp_tiles
        total = tiles.to(gl.int64) * k_units
        pid = gl.program_id(0).to(gl.int64)
        start = (pid * total // gl.num_programs(0)).to(gl.int32)
        end = ((pid + 1) * total // gl.num_programs(0)).to(gl.int32)
        if DP:
            start += dp_tiles * k_units
            end += dp_tiles * k_units
    else:
        start = gl.program_id(0) * k_units + gl.program_id(1) * units_per_split
        end = gl.minimum(start + units_per_split, (gl.program_id(0) + 1) * k_units)
    if DP:
        stretches = dp_tiles // gl.num_programs(0) + 1  # the whole tiles' waves, then the run
    else:
        stretches = 1  # (a loop of one step: folded away)
    return start, end, k_units, stretches


@gluon.jit
def _stretch(s, start, end, k_units, dp_tiles, DP: gl.constexpr):
    """Stretch ``s`` of a program's pairs: with ``DP``, wave s's whole tile (tile s P + p of program p) while
    that is one of the first dp_tiles, then the program's stream-K run [start, end) (none where every tile is
    whole: a persistent launch, whose last wave may be partial). (With clusters of two, P even and dp_tiles
    even, programs 2 c and 2 c + 1 take tiles 2 q and 2 q + 1 of a wave: a pair, as :func:`_segment` has
    it.)"""
    lo = start
    hi = end
    if DP:
        if s * gl.num_programs(0) + gl.program_id(0) < dp_tiles:
            lo = (s * gl.num_programs(0) + gl.program_id(0)) * k_units
            hi = lo + k_units
    return lo, hi


@gluon.jit
def _segment(unit, end, k_units, tiles_m, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             CLUSTER: gl.constexpr = 1):  # fmt: skip
    """The output tile that K unit ``unit`` of a run ending at ``end`` belongs to: (tile, its first unit
    here, how many of its units the run holds from there, the tile's row and weight-row offsets). Tiles go
    rows first (programs sharing a weight tile run together); with ``CLUSTER`` 2, tiles 2 c and 2 c + 1 (a
    cluster's two programs) share their rows of x and take neighbouring weight tiles."""
    tile = unit // k_units
    u0 = unit - tile * k_units
    if CLUSTER == 2:
        pair = tile // 2
        off_m = (pair % tiles_m) * BLOCK_M
        off_n = ((pair // tiles_m) * 2 + tile % 2) * BLOCK_N
    else:
        off_m = (tile % tiles_m) * BLOCK_M
        off_n = (tile // tiles_m) * BLOCK_N
    return tile, u0, gl.minimum(k_units - u0, end - unit), off_m, off_n


@gluon.jit
def _load_stage(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, stage, g, t, off_m, off_n,
                WITH_X: gl.constexpr, SCALES_TMA: gl.constexpr, BLOCK_K: gl.constexpr,
                STAGES: gl.constexpr, CLUSTER: gl.constexpr = 1):  # fmt: skip
    """K tile ``t`` into ring stage ``stage`` (the ``g``-th tile loaded) once it is free: its words (and
    scales), and with ``WITH_X`` x's tile; the stage's ``ready`` expects x's tile either way (without
    ``WITH_X`` the caller issues it apart: PDL's, after its wait)."""
    # (a fresh barrier: phase 1 is done)
    mbarrier.wait(empty.index(stage), ((g // STAGES) & 1) ^ 1)
    bar = ready.index(stage)
    # (with CLUSTER 2, x_desc's box is half the tile: each program's half comes to both, ptx_cluster's pass)
    x_bytes: gl.constexpr = x_desc.block_type.nbytes * CLUSTER
    if SCALES_TMA:
        mbarrier.expect(bar, x_bytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes)
        _tma_load(s_desc, [off_n, t * 8], bar, s_smem.index(stage))
    else:
        mbarrier.expect(bar, x_bytes + w_desc.block_type.nbytes)
    if WITH_X:
        if CLUSTER == 2:
            half: gl.constexpr = x_desc.block_type.shape[0]
            rank = gl.program_id(0) % 2
            _tma_load(x_desc, [off_m, t * BLOCK_K], bar, x_smem.index(stage).slice(0, half), pred=rank == 0)
            _tma_load(x_desc, [off_m + half, t * BLOCK_K], bar, x_smem.index(stage).slice(half, half),
                      pred=rank == 1)  # fmt: skip
        else:
            _tma_load(x_desc, [off_m, t * BLOCK_K], bar, x_smem.index(stage))
    _tma_load(w_desc, [off_n, t * (BLOCK_K // 8)], bar, w_smem.index(stage))


@gluon.jit
def _load_partition(
    x_desc,
    w_desc,
    s_desc,
    x_smem,
    w_smem,
    s_smem,
    ready,
    empty,
    M,
    N,
    K,
    units_per_split,
    dp_tiles,
    STREAM_K: gl.constexpr,
    DP: gl.constexpr,
    SCALES_TMA: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    PDL: gl.constexpr,
    CLUSTER: gl.constexpr,
):
    """The loading warp: every K tile of the program's run, in order, into the ring's next stage once the
    products of the tile it held are done (``empty``); TMA signals ``ready`` when the bytes are in. With
    ``SCALES_TMA`` the tile's scales too ([BLOCK_N, 8] of the [N, groups] scales: eight groups a tile).
    ``PDL`` (launched as a programmatic dependent): the weight's words (and scales) of the run's first
    stages, which no kernel before this one writes, go out before the wait for that kernel
    (:func:`_grid_dependency_wait`); x's tiles after it."""
    start, end, k_units, stretches = _share(M, N, K, units_per_split, dp_tiles, STREAM_K, DP, BLOCK_M,
                                            BLOCK_N, BLOCK_K)  # fmt: skip
    tiles_m = gl.cdiv(M, BLOCK_M)
    if CLUSTER > 1:
        _cluster_wait()
    _launch_dependents()  # (a kernel launched after this one as its programmatic dependent may start)
    if PDL:
        lo, hi = _stretch(0, start, end, k_units, dp_tiles, DP)
        ahead = lo * 0  # the run's first K tiles whose words went out before the wait
        if lo < hi:
            tile, u0, units, off_m, off_n = _segment(lo, hi, k_units, tiles_m, BLOCK_M, BLOCK_N)
            ahead = gl.minimum(2 * units, STAGES)
            for t in range(2 * u0, 2 * u0 + ahead):
                _load_stage(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, t - 2 * u0,
                            t - 2 * u0, t, off_m, off_n, False, SCALES_TMA, BLOCK_K, STAGES)  # fmt: skip
        _grid_dependency_wait()
    g = 0  # K tiles loaded so far: the ring's position and phase
    for s in range(stretches):
        lo, hi = _stretch(s, start, end, k_units, dp_tiles, DP)
        unit = lo
        while unit < hi:
            tile, u0, units, off_m, off_n = _segment(unit, hi, k_units, tiles_m, BLOCK_M, BLOCK_N, CLUSTER)
            for t in range(2 * u0, 2 * (u0 + units)):
                stage = g % STAGES
                if PDL:
                    bar = ready.index(stage)
                    if g >= ahead:  # (the first ``ahead`` tiles' words are out already)
                        _load_stage(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, stage, g, t,
                                    off_m, off_n, False, SCALES_TMA, BLOCK_K, STAGES)  # fmt: skip
                    _tma_load(x_desc, [off_m, t * BLOCK_K], bar, x_smem.index(stage))
                else:
                    _load_stage(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, stage, g, t,
                                off_m, off_n, True, SCALES_TMA, BLOCK_K, STAGES, CLUSTER)  # fmt: skip
                g += 1
            unit += units


@gluon.jit
def _compute_partition(
    x_smem,
    w_smem,
    s_smem,
    y_smem,
    ready,
    empty,
    y_desc,
    scale_ptr,
    zero_ptr,
    y_ptr,
    ws_ptr,
    count_ptr,
    M,
    N,
    K,
    scale_row_stride,
    zero_row_stride,
    y_row_stride,
    units_per_split,
    dp_tiles,
    MODE: gl.constexpr,
    TMA_STORE: gl.constexpr,
    STREAM_K: gl.constexpr,
    DP: gl.constexpr,
    LATE_FIRST: gl.constexpr,
    OWNED: gl.constexpr,
    GROUP: gl.constexpr,
    HAS_ZERO: gl.constexpr,
    ZERO_ROWS: gl.constexpr,
    SCALES_TMA: gl.constexpr,
    MAGIC_F: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    PDL: gl.constexpr,
    RELEASES: gl.constexpr,
    CLUSTER: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The products, tile by tile: tile t's run on the tensor cores while tile t + 1's operand is made from
    its stage; once tile t - 1's are done its stage goes back to the loader. Then each output tile's sum,
    or part of it, goes out (``_write``)."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    w_layout: gl.constexpr = _word_layout(BLOCK_N, BLOCK_K, num_warps, OWNED)
    dtype: gl.constexpr = x_smem.dtype
    p = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, w_layout)))
    if OWNED:
        select = gl.expand_dims(gl.expand_dims(4 * p, 0), 1)  # [1, 1, 4]: pair p's shift
    else:
        select = gl.expand_dims(gl.expand_dims(p + 0x4440, 0), 1)  # [1, 1, 4]: byte p, as prmt takes it
    start, end, k_units, stretches = _share(M, N, K, units_per_split, dp_tiles, STREAM_K, DP, BLOCK_M,
                                            BLOCK_N, BLOCK_K)  # fmt: skip
    tiles_m = gl.cdiv(M, BLOCK_M)
    if RELEASES > 1:  # each warpgroup frees its stages itself (ptx_release's pass; the ring counts RELEASES)
        _mark_release()
    if PDL:  # (y, the workspace and its counts may still be the kernel before's)
        _grid_dependency_wait()
    g = 0  # K tiles consumed so far, as the loader counts them
    for s in range(stretches):
        lo, hi = _stretch(s, start, end, k_units, dp_tiles, DP)
        unit = lo
        while unit < hi:
            tile, u0, units, off_m, off_n = _segment(unit, hi, k_units, tiles_m, BLOCK_M, BLOCK_N, CLUSTER)
            offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, w_layout)))
            mask_n = offs_n < N
            first = 2 * u0
            n_local = 2 * units
            # Scales and zero points run three tiles ahead of the products (plain loads: their latency is
            # hidden).
            params0 = _load_params(scale_ptr, zero_ptr, offs_n, mask_n, first, K, scale_row_stride,
                                   zero_row_stride, GROUP, HAS_ZERO, ZERO_ROWS, SCALES_TMA, MAGIC_F,
                                   BLOCK_K, num_warps)  # fmt: skip
            params1 = _load_params(scale_ptr, zero_ptr, offs_n, mask_n, first + 1, K, scale_row_stride,
                                   zero_row_stride, GROUP, HAS_ZERO, ZERO_ROWS, SCALES_TMA, MAGIC_F,
                                   BLOCK_K, num_warps)  # fmt: skip
            params2 = _load_params(scale_ptr, zero_ptr, offs_n, mask_n, first + 2, K, scale_row_stride,
                                   zero_row_stride, GROUP, HAS_ZERO, ZERO_ROWS, SCALES_TMA, MAGIC_F,
                                   BLOCK_K, num_warps)  # fmt: skip
            mbarrier.wait(ready.index(g % STAGES), (g // STAGES) & 1)
            if SCALES_TMA:
                staged = _stage_scales(s_smem, g % STAGES, BLOCK_N, BLOCK_K // GROUP, num_warps)
                params0 = (staged, params0[1])
            a0 = _operand(w_smem.index(g % STAGES), params0, select, dtype, w_layout, a_layout, GROUP,
                          BLOCK_N, BLOCK_K, num_warps, OWNED, ZERO_ROWS)  # fmt: skip
            a1 = a0
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma_layout)
            # Two tiles an iteration, so that the operands of consecutive tiles are distinct registers (a
            # loop-carried operand would be rewritten in place while its products may still read it, and ptxas
            # then runs every product synchronously).
            for i in range(0, n_local, 2):
                for j in gl.static_range(2):
                    t = g + i + j
                    acc = warpgroup_mma(a0, x_smem.index(t % STAGES).permute((1, 0)), acc, is_async=True)
                    acc, a1 = warpgroup_mma_wait(num_outstanding=1, deps=[acc, a1])
                    # tile t - 1's products are done (its words were read into a1 before they started)
                    mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), pred=i + j > 0)
                    params3 = _load_params(scale_ptr, zero_ptr, offs_n, mask_n, first + i + j + 3, K,
                                           scale_row_stride, zero_row_stride, GROUP, HAS_ZERO, ZERO_ROWS,
                                           SCALES_TMA, MAGIC_F, BLOCK_K, num_warps)  # fmt: skip
                    # (the last tile makes an operand nobody uses, from whatever its stage holds)
                    nxt = (t + 1) % STAGES
                    mbarrier.wait(ready.index(nxt), ((t + 1) // STAGES) & 1, pred=i + j + 1 < n_local)
                    if SCALES_TMA:
                        staged = _stage_scales(s_smem, nxt, BLOCK_N, BLOCK_K // GROUP, num_warps)
                        params1 = (staged, params1[1])
                    a_next = _operand(w_smem.index(nxt), params1, select, dtype, w_layout, a_layout,
                                      GROUP, BLOCK_N, BLOCK_K, num_warps, OWNED, ZERO_ROWS)  # fmt: skip
                    params1, params2 = params2, params3
                    a1 = a0  # tile t's operand: in flight until the next wait
                    a0 = a_next
            acc, a0, a1 = warpgroup_mma_wait(num_outstanding=0, deps=[acc, a0, a1])
            g += n_local
            mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES))
            # A run's part of a tile is likely its tile's last where it ends the run and starts the tile after
            # other work of the run: the tile's other parts began other runs, as all the programs began.
            late = (u0 == 0) & (unit > start) & (unit + units == hi) & LATE_FIRST
            _write(acc, y_desc, y_smem, y_ptr, ws_ptr, count_ptr, tile, units == k_units, late, units,
                   k_units, off_m, off_n, M, N, y_row_stride, MODE, TMA_STORE, BLOCK_M, BLOCK_N,
                   num_warps)  # fmt: skip
            unit += units
    if TMA_STORE:
        tma.store_wait(0)  # (the last tile's store has read y_smem before the program ends)
    if CLUSTER > 1:
        # The other program of the cluster frees our stages too (its last releases may come after ours):
        # the program ends once every stage's last release, its and ours, is in (no arrival then reaches
        # a program that has ended).
        for s in gl.static_range(STAGES):
            uses = (g - s + STAGES - 1) // STAGES
            mbarrier.wait(empty.index(s), (uses - 1) & 1, pred=uses > 0)


@gluon.jit
def _ring(x_desc, w_desc, s_desc, y_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
          STAGES: gl.constexpr, SCALES_TMA: gl.constexpr, RELEASES: gl.constexpr, CLUSTER: gl.constexpr,
          TMA_STORE: gl.constexpr):  # fmt: skip
    """The ring of STAGES shared-memory stages (x tile, weight words, and with ``SCALES_TMA`` the tile's
    scales) the loading warp fills, with each stage's ``ready`` (TMA's bytes in) and ``empty`` (its
    products done) barriers."""
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 8], w_desc.layout)
    if SCALES_TMA:
        s_smem = gl.allocate_shared_memory(s_desc.dtype, [STAGES, BLOCK_N, 8], s_desc.layout)
    else:
        s_smem = w_smem  # (unused)
    if TMA_STORE:  # y's tile, as TMA stores it ([BLOCK_M, BLOCK_N]; the products are its transpose)
        y_smem = gl.allocate_shared_memory(y_desc.dtype, [BLOCK_M, BLOCK_N], y_desc.layout)
    else:
        y_smem = w_smem  # (unused)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        # (one arrival: the partition syncs, then one thread arrives; RELEASES: one a warpgroup, ptx_release)
        mbarrier.init(empty.index(s), count=RELEASES * CLUSTER)
    if CLUSTER > 1:  # (the barriers are the cluster's before either program loads into or frees the other's)
        _cluster_start()
    return x_smem, w_smem, s_smem, y_smem, ready, empty


@gluon.jit
def _wgmma_kernel(
    x_desc,  # TMA descriptor of x [M, K], blocks [BLOCK_M, BLOCK_K]
    w_desc,  # TMA descriptor of the packed weight [N, K / 8] int32, blocks [BLOCK_N, BLOCK_K / 8]
    s_desc,  # SCALES_TMA: TMA descriptor of the scales [N, K / GROUP], blocks [BLOCK_N, 8]; else x_desc
    y_desc,  # TMA_STORE: TMA descriptor of y [M, N], blocks [BLOCK_M, BLOCK_N]; else x_desc
    scale_ptr,  # [N, ceil(K / GROUP)], the activation dtype
    zero_ptr,  # int32 packed zero points [ceil(N / 8), ceil(K / GROUP)] (HAS_ZERO; ZERO_ROWS: [N, ...])
    y_ptr,  # [M, N]: the activation dtype, or fp32 partial sums (MODE 1)
    ws_ptr,  # fp32 workspace, zero between calls (MODE 2)
    count_ptr,  # int32 K units done per output tile, zero between calls (MODE 2)
    M,
    N,
    K,
    scale_row_stride,
    zero_row_stride,
    y_row_stride,
    units_per_split,  # split mode: K units (two K tiles each) a program_id(1)
    dp_tiles,  # stream-K: tiles the programs take whole first, a wave at a time (a multiple of the programs,
    # but in a persistent launch: all the tiles)
    MODE: gl.constexpr,  # how parts of a tile meet: 0 never split, 1 fp32 atomics into y, 2 workspace
    TMA_STORE: gl.constexpr,  # MODE 0: each tile's sum goes out through shared memory by TMA (tma_store)
    STREAM_K: gl.constexpr,  # the programs share the (tile, K unit) pairs evenly, in order
    DP: gl.constexpr,  # dp_tiles > 0
    LATE_FIRST: gl.constexpr,  # MODE 2: a tile's likely last part reads the count first (_write's ``late``)
    OWNED: gl.constexpr,  # the words are in quant_layout.to_owned_order's order
    GROUP: gl.constexpr,
    HAS_ZERO: gl.constexpr,
    ZERO_ROWS: gl.constexpr,  # zero points as quant_layout.to_owned_zeros lays them out
    SCALES_TMA: gl.constexpr,  # eight groups a K tile: the scales come with the words, by TMA
    MAGIC_F: gl.constexpr,  # 128.0 (bf16) or 1024.0 (fp16): the value of the bits OR-ed over each q
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    PDL: gl.constexpr,  # launched as a programmatic dependent (launch_args' ``pdl``)
    RELEASES: gl.constexpr,  # arrivals that free a stage: 1, or a warpgroup's each (launch_args' wg_release)
    CLUSTER: gl.constexpr,  # 2: clusters of two programs sharing x's tiles (launch_args' cluster)
    num_warps: gl.constexpr,
):
    x_smem, w_smem, s_smem, y_smem, ready, empty = _ring(x_desc, w_desc, s_desc, y_desc, BLOCK_M, BLOCK_N,
                                                         BLOCK_K, STAGES, SCALES_TMA, RELEASES, CLUSTER,
                                                         TMA_STORE)  # fmt: skip
    # One loading warp of 24 registers (scalars only; the least a warp may have). (The partitions' arguments
    # are written out in the call: a tuple bound to a name first turns the constexprs in it into tensors.)
    gl.warp_specialize(
        [
            (_compute_partition, (x_smem, w_smem, s_smem, y_smem, ready, empty, y_desc, scale_ptr, zero_ptr,
                                  y_ptr, ws_ptr, count_ptr, M, N, K, scale_row_stride, zero_row_stride,
                                  y_row_stride, units_per_split, dp_tiles, MODE, TMA_STORE, STREAM_K, DP,
                                  LATE_FIRST, OWNED, GROUP, HAS_ZERO, ZERO_ROWS, SCALES_TMA, MAGIC_F, BLOCK_M,
                                  BLOCK_N, BLOCK_K, STAGES, PDL, RELEASES, CLUSTER, num_warps)),
            (_load_partition, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, M, N, K,
                               units_per_split, dp_tiles, STREAM_K, DP, SCALES_TMA, BLOCK_M, BLOCK_N, BLOCK_K,
                               STAGES, PDL, CLUSTER)),
        ],
        [1],
        [24],
    )  # fmt: skip


# Triton's own dispatch (``_wgmma_kernel[grid]``) costs 10-40 us more host time a call than FastLaunch, which
# keys the compiled kernel on the descriptors' specialization and calls its launcher directly (H100 host,
# tests/gpu/launch_probe.py --quant; results/quant_host_h100_2026-11-25_gluon.log).
_LAUNCH = FastLaunch(_wgmma_kernel)


def supported(
    x2: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bits: int,
    block_k: int = 64,
) -> bool:
    """Whether :func:`prefill` takes these inputs (see the module doc's scope); TMA also needs 16-byte
    aligned rows."""
    return (
        bits == 4
        and x2.dtype in (torch.bfloat16, torch.float16)
        and scales.dtype == x2.dtype
        # one group a K tile, two, or (where K is whole tiles) four or eight
        and (group_size % block_k == 0 or block_k == 2 * group_size or _many_groups(x2, group_size, block_k))
        and x2.shape[-1] % 32 == 0  # the words' rows, 16-byte aligned for TMA
        and x2.shape[-1] > 0
        and x2.shape[0] > 0  # (a descriptor takes no empty dimension)
        and qweight.stride(-1) == 1
        and qweight.data_ptr() % 16 == 0
        and (qweight.stride(0) * 4) % 16 == 0
        and x2.stride(-1) == 1
        and (x2.stride(0) * x2.element_size()) % 16 == 0
        and x2.data_ptr() % 16 == 0
    )


def _many_groups(x2: torch.Tensor, group_size: int, block_k: int) -> bool:
    """Four or eight groups a K tile (:func:`_load_params`), of 32 values or more (what was tested: g32
    and g64 in 256-deep tiles), K whole tiles (so that a tile's mask is its rows')."""
    return (
        block_k % group_size == 0
        and block_k // group_size in (4, 8)
        and group_size >= 32
        and x2.shape[-1] % block_k == 0
    )


@functools.cache
def _smem_layout(rows: int, cols: int, dtype: torch.dtype = torch.int32):
    """The shared-memory layout of a TMA block (cached: computing it takes ~6 us of a call's host time)."""
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.int32: gl.int32}[dtype]
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl_dtype)


def launch(x2, qweight, scales, zeros, group_size, y, ws, counts, **tiling) -> None:
    """y [M, N] = x2 [M, K] @ dequantize(W).T on the Gluon kernel (:func:`launch_args` says how)."""
    grid, args, kwargs = launch_args(x2, qweight, scales, zeros, group_size, y, ws, counts, **tiling)
    if kwargs["CLUSTER"] > 1 and not capturing():  # (captured launches run nowhere: cross_compile's)
        _check_clustered(grid, args, kwargs)
    _LAUNCH[grid](*args, **kwargs)


_CLUSTERED: set = set()  # specialization keys whose kernel ptx_cluster made a cluster's


def _check_clustered(grid, args, kwargs) -> None:
    """Before a CLUSTER kernel's first launch: compiled (not launched), it must be ptx_cluster's, launched in
    clusters (its metadata's num_ctas); compiled without the pass (another stages hook in its place), its
    ring would wait for releases nobody sends."""
    key = specialization_key(args, kwargs, _LAUNCH.constexpr_positions)
    if key is not None and key in _CLUSTERED:
        return
    compiled = _wgmma_kernel.warmup(*args, grid=grid, **kwargs)
    if getattr(compiled.metadata, "num_ctas", 1) != kwargs["CLUSTER"]:
        raise ptx_cluster.ClusterError("ptx_cluster: the kernel was compiled without the pass")
    if key is not None:
        _CLUSTERED.add(key)


def launch_args(
    x2,
    qweight,
    scales,
    zeros,
    group_size,
    y,
    ws,
    counts,
    *,
    block_m,
    split=1,
    programs=0,
    dp_waves=0,
    mode=0,
    block_n=128,
    block_k=64,
    stages=4,
    num_warps=8,
    occupancy=1,
    late_first=True,
    owned=False,
    zero_rows=None,
    pdl=False,
    wg_release=False,
    cluster=1,
    persistent=False,
    tma_store=False,
) -> tuple[tuple, tuple, dict]:
    """The grid, arguments and keywords of the Gluon kernel's launch for y [M, N] = x2 [M, K] @
    dequantize(W).T: each output tile's K split ``split`` ways, or, with ``programs``, all (tile, K unit)
    pairs shared evenly by that many programs (stream-K); with ``dp_waves`` these first take that many waves
    of whole tiles, one a program a wave, and share the rest (negative: all the full waves but that many).
    Parts of a tile meet as ``mode`` says, in ``y`` (fp32, zeroed) or in the clean workspace ``ws``/``counts``
    (a counter per output tile). Registers are capped for ``occupancy`` programs an SM. ``late_first``: a
    tile's likely last part reads the count before it adds its own (``_write``'s ``late``; off: as before the
    eighteenth session, for probes). ``owned``: ``qweight`` is in quant_layout.to_owned_order's order, and
    ``zeros`` (by default; ``zero_rows`` says otherwise, for probes) in to_owned_zeros' layout. ``pdl``:
    launched as a programmatic dependent of the kernel before it in the stream
    (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION), which pays only where that kernel calls
    launch_dependents (quant_matmul.PDL_MAX_M). ``wg_release``: each warpgroup of the compute partition frees
    its ring stages itself, not the partition's thread 0 after a barrier of all its warps
    (:mod:`ptx_release`'s pass over the PTX; two warpgroups or more). ``cluster`` 2: clusters of two programs
    sharing x's tiles (:mod:`ptx_cluster`'s pass; whole tiles, an even count of weight tiles; the grid counts
    clusters). ``persistent`` (with ``programs``): every tile whole, the programs taking a wave of tiles at a
    time (the last may be partial), each program's loading warp filling the next tile's stages while its
    compute warps write the last one's sum. ``tma_store`` (tiles never split, y in x's dtype): each tile's sum
    goes out through shared memory by a TMA store, which the compute warps do not wait for. (Apart from
    :func:`launch`, for compiling what a launch would run without a GPU: ``cross_compile.compile_for``.)"""
    m, k_in = x2.shape
    n_out = qweight.shape[0]
    k_units = cdiv(cdiv(k_in, block_k), 2)
    tiles = cdiv(m, block_m) * cdiv(n_out, block_n)
    dp_tiles = 0
    if persistent and not programs:
        raise ValueError("quant_matmul_gluon.launch: a persistent launch needs its programs")
    if persistent:
        grid = (min(programs, tiles),)
        units_per_split = k_units
        dp_tiles = tiles
        parts = False
    elif programs:
        grid = (min(programs, tiles * k_units),)
        units_per_split = k_units
        waves = tiles // grid[0]
        dp_tiles = max(0, min(dp_waves, waves) if dp_waves >= 0 else waves + dp_waves) * grid[0]
        parts = (tiles - dp_tiles) % grid[0] != 0  # a program's share ends inside a tile
    else:
        units_per_split = cdiv(k_units, split)
        grid = (tiles, cdiv(k_units, units_per_split))
        parts = grid[1] > 1
    if parts and mode == 0:
        raise ValueError("quant_matmul_gluon.launch: split tiles need mode 1 or 2")
    if cluster not in (1, 2):
        raise ValueError(f"quant_matmul_gluon.launch: clusters of 1 or 2 programs, not {cluster}")
    if cluster == 2:
        if (
            (programs and not persistent)
            or grid[0] % 2
            or parts
            or pdl
            or wg_release
            or cdiv(n_out, block_n) % 2
        ):
            raise ValueError(
                "quant_matmul_gluon.launch: clusters take whole tiles (a tile a program, or persistent on an "
                "even count of programs), an even count of weight tiles, no PDL or warpgroup releases"
            )
        grid = (grid[0] // 2, 1)  # (clusters: Triton's launcher multiplies by the cluster's programs)
    x_box = block_m // cluster
    x_desc = TensorDescriptor.from_tensor(x2, [x_box, block_k], _smem_layout(block_m, block_k, x2.dtype))
    w_desc = TensorDescriptor.from_tensor(
        qweight, [block_n, block_k // 8], _smem_layout(block_n, block_k // 8)
    )
    if tma_store and (parts or not tma_storable(x2, y)):
        raise ValueError(
            "quant_matmul_gluon.launch: a TMA store takes whole tiles into a y of x's dtype, its start and "
            "rows 16-byte aligned"
        )
    y_desc = (
        TensorDescriptor.from_tensor(y, [block_m, block_n], _smem_layout(block_m, block_n, y.dtype))
        if tma_store
        else x_desc
    )
    zero_arg = zeros if zeros is not None else qweight
    scales_tma = _scales_by_tma(scales, group_size, block_m, block_n, block_k, stages)
    s_desc = (
        TensorDescriptor.from_tensor(scales, [block_n, 8], _smem_layout(block_n, 8, scales.dtype))
        if scales_tma
        else x_desc
    )
    # The loading warp takes a whole warpgroup's registers: (num_warps + 4) warps of maxnreg registers, of
    # which the compute partition takes what the loader leaves.
    maxnreg = min(255, 65536 // occupancy // (32 * (num_warps + 4))) // 8 * 8
    args = (x_desc, w_desc, s_desc, y_desc, scales, zero_arg, y, ws, counts, m, n_out, k_in, scales.stride(0),
            zero_arg.stride(0), y.stride(0), units_per_split, dp_tiles)  # fmt: skip
    kwargs = {
        "MODE": mode if parts else 0,
        "TMA_STORE": bool(tma_store),
        "STREAM_K": bool(programs),
        "DP": dp_tiles > 0,
        "LATE_FIRST": bool(late_first),
        "OWNED": bool(owned),
        "GROUP": group_size,
        "HAS_ZERO": zeros is not None,
        "ZERO_ROWS": zeros is not None and (owned if zero_rows is None else bool(zero_rows)),
        "SCALES_TMA": scales_tma,
        "MAGIC_F": 128.0 if x2.dtype == torch.bfloat16 else 1024.0,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "STAGES": stages,
        "PDL": bool(pdl),
        "RELEASES": num_warps // 4 if wg_release else 1,
        "CLUSTER": cluster,
        "num_warps": num_warps,
        "maxnreg": maxnreg,
    }
    if kwargs["RELEASES"] > 1 or cluster > 1:
        ptx_release.install()
    if kwargs["PDL"]:
        kwargs["launch_pdl"] = (
            True  # (Triton's launcher: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        )
    return grid, args, kwargs


def tma_storable(x2: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether tiles of ``y`` can go out by TMA (``launch_args``' ``tma_store``): x's dtype, unit stride along
    a row, rows and the start 16-byte aligned (TMA's)."""
    size = y.element_size()
    return (
        y.dtype == x2.dtype
        and y.stride(-1) == 1
        and (y.stride(0) * size) % 16 == 0
        and y.data_ptr() % 16 == 0
    )


# Scales by TMA where the ring of stages holds them too, up to this many bytes of x and words: the 64-row
# decode tiling's 192 KB ring with its scales needed 237,636 bytes of shared memory, past the H100's 232,448.
TMA_SCALES_MAX_RING = 160 * 1024


def _scales_by_tma(scales, group_size, block_m, block_n, block_k, stages) -> bool:
    """Whether a K tile's scales come with its words by TMA (``SCALES_TMA``): eight groups a tile, as a
    [block_n, 8] box of the [N, groups] scales (16 bytes a row, TMA's least; TMA's 16-byte aligned rows), and
    room in the ring. Measured on the H100 (g32, owned words, 1-32 rows): 1.07-1.15x, up to 2.4 us of a
    14336 x 4096 decode's 19-23, within 0.6-1.0 us there of scales read from the L2 alone (1.3-2.4 us at
    28672 x 4096; NOTES.md, twenty-second session). Four groups a tile would be an 8-byte box: plain loads."""
    size = scales.element_size()
    ring = stages * (block_m * block_k * size + block_n * block_k // 2)
    return (
        block_k == 8 * group_size
        and scales.stride(-1) == 1
        and (scales.stride(0) * size) % 16 == 0
        and scales.data_ptr() % 16 == 0
        and ring <= TMA_SCALES_MAX_RING
    )


def prefill(x2, qweight, scales, zeros, group_size, **tiling) -> torch.Tensor:
    """:func:`launch` into a new output (parts of tiles summed in fp32, then cast), ``tiling`` its keywords
    (``block_m`` 128 unless given): for probes and tests."""
    y = torch.zeros((x2.shape[0], qweight.shape[0]), dtype=torch.float32, device=x2.device)
    launch(x2, qweight, scales, zeros, group_size, y, y, y, mode=1, **({"block_m": 128} | tiling))
    return y.to(x2.dtype)
