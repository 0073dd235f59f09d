"""Weight-only quantized matmul: ``y = x @ dequantize(W).T`` over compressed-tensors' pack-quantized layout.

The layout is defined once, in ``kernels/quant_layout.py``: ``qweight`` int32 [N, ceil(K / P)] packed
along K (P = 32 // bits, lowest bits first, offset-binary), ``scales`` [N, ceil(K / G)], optional
``zeros`` int32 [ceil(N / P), ceil(K / G)] packed along N.

Decode and batched decode (M <= SKINNY_MAX_M) stream the packed weight with as little arithmetic per
weight as possible: one row (M <= GEMV_MAX_M) on the FMA units (:func:`_gemv_int4_kernel` for int4,
:func:`_gemv_kernel` for int8), more rows on tensor cores (:func:`_skinny_kernel`):

- Wide, pipelined loads: when K is a multiple of the tile (``EVEN_K``) no K mask is applied, so the weight
  tile loads are 16-byte vectors that Triton turns into multi-stage ``cp.async`` pipelines (with a mask of
  unknown alignment they were one int16 per instruction and not pipelined). The activation tile is loaded
  contiguously and split by position within a word in registers (:func:`_deinterleave`).
- Swapped operands: each program computes ``acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile.T``, so the weight,
  the big operand, is the MMA's A operand in its stored K-major order, and the few activation rows are B.
- No unpacking reshape: the packed words are read as int16 (4 int4 / 2 int8 values each, value k of a row
  at int16 ``k // V``, position ``k % V``). Position ``i`` of every int16 in a tile is one [BLOCK_N, T]
  operand whose columns are k = 4t + i; it meets the activations at the same k. V dots of depth
  T = BLOCK_K / V replace one dot of depth BLOCK_K.
- No conversion instructions (int-to-float runs at 1/8 of the FMA rate and would bound the kernel): a value
  q is turned into the float ``BIAS + q`` by OR-ing it into the mantissa of ``BIAS`` (0x4300 = 128.0 in
  bf16, 0x6400 = 1024.0 in fp16; exact since q < 2**7 resp. 2**10), then bitcast. The int4 FMA kernel does
  two values per instruction (``0x43004300`` over an int32 word). int8 with bf16 activations (q up to 255
  does not fit) goes through the fp32 magic 2**23 and one conversion.
- Scale and zero point after the dot: a tile is one quantization group, so
  ``sum_k (q - z) s x = s * (sum_k (BIAS + q) x - (BIAS + z) * sum_k x)``; the correction is per (row, group).
  Groups narrower than a dot's minimum depth (int4 with G < 64, or G not a multiple of V) take the PRESCALE
  form instead: w = (q - z) * s per weight, then the dot. Scales are loaded one tile ahead, as one
  [BLOCK_N, groups per tile] block when groups tile the K tile (:func:`_tile_params`).
- Split-K across programs when N alone gives too few programs to fill the GPU (fp32 atomics into a zeroed
  buffer).

Prefill (M > SKINNY_MAX_M) is compute-bound: :func:`_dequantize_kernel` expands W to the activation dtype
once (bit-exact, as compressed-tensors dequantizes) and cuBLAS does the matmul. The transient weight
costs N x K x 2 bytes; at 4096 rows it is read 4096 times, so the expansion (a memory-bound pass) is a
small part of the time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from squeezeserve.kernels import quant_layout, reference
from squeezeserve.kernels.ops.launch import cdiv, next_power_of_2, sm_count, traceable
from squeezeserve.kernels.registry import eager, interpreting, use_reference

SKINNY_MAX_M = 64
GEMV_MAX_M = 1  # rows up to which the FMA kernel beats the tensor-core one (sweep: 2 rows already lose)
# bf16: 0x4300 is 128.0 with a 7-bit mantissa (integers 128..255 exact); fp16: 0x6400 is 1024.0 with a
# 10-bit mantissa (1024..2047 exact).
_MAGIC = {torch.bfloat16: (0x4300, 128.0, 7), torch.float16: (0x6400, 1024.0, 10)}


@triton.jit
def _group_params(scale_ptr, zero_ptr, rows, g, mask, scale_row_stride, zero_row_stride, BITS: tl.constexpr,
                  HAS_ZERO: tl.constexpr):  # fmt: skip
    """(scale, zero point) in fp32 of output rows ``rows`` in groups ``g`` (broadcast against each other).

    Zero points are packed along N (``32 // BITS`` rows per int32); without them the zero point is the
    offset-binary midpoint ``2**(BITS-1)``.
    """
    PACK: tl.constexpr = 32 // BITS
    s = tl.load(scale_ptr + rows.to(tl.int64) * scale_row_stride + g, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZERO:
        zw = tl.load(zero_ptr + (rows // PACK) * zero_row_stride + g, mask=mask, other=0)
        z = ((zw >> ((rows % PACK) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
    else:
        z = tl.zeros_like(s) + (1 << (BITS - 1))
    return s, z


@triton.jit
def _tile_params(scale_ptr, zero_ptr, offs_n, mask_n, tile, K, scale_row_stride, zero_row_stride,
                 BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_K: tl.constexpr,
                 GPT: tl.constexpr):  # fmt: skip
    """(scale, zero point) [BLOCK_N, GPT] of the GPT groups that K tile ``tile`` spans (groups aligned to
    tiles: GPT = BLOCK_K / GROUP, or 1 when a group holds whole tiles)."""
    groups = (tile * BLOCK_K) // GROUP + tl.arange(0, GPT)
    mask = mask_n[:, None] & (groups < tl.cdiv(K, GROUP))[None, :]
    return _group_params(scale_ptr, zero_ptr, offs_n[:, None], groups[None, :], mask, scale_row_stride,
                         zero_row_stride, BITS, HAS_ZERO)  # fmt: skip


@triton.jit
def _per_word(v, BLOCK_N: tl.constexpr, GPT: tl.constexpr, W: tl.constexpr):
    """[BLOCK_N, GPT] per-group values -> [BLOCK_N, W] per word (a tile's W words in GPT equal runs)."""
    if GPT == 1:
        return v
    else:
        return tl.reshape(tl.broadcast_to(v[:, :, None], [BLOCK_N, GPT, W // GPT]), [BLOCK_N, W])


@triton.jit
def _write_tile(acc, y_ptr, ws_ptr, count_ptr, offs_n, offs_m, mask_n, mask_m, y_row_stride, n_splits,
                MODE: tl.constexpr):  # fmt: skip
    """y[m, n] = acc[n, m]. MODE 0: stored in y's dtype (one program per tile). MODE 1: added in fp32 into a
    zeroed y (split-K; the launcher casts). MODE 2: added into the fp32 workspace; the tile's last split
    (counted with an atomic) stores the sum in y's dtype and zeroes its workspace tile and counter again,
    so the next call finds them clean: one launch, no memset and no cast kernel."""
    y_ptrs = y_ptr + offs_m[None, :].to(tl.int64) * y_row_stride + offs_n[:, None]
    y_mask = mask_n[:, None] & mask_m[None, :]
    if MODE == 0:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    elif MODE == 1:
        tl.atomic_add(y_ptrs, acc, mask=y_mask, sem="relaxed")
    else:
        ws_ptrs = ws_ptr + offs_m[None, :].to(tl.int64) * y_row_stride + offs_n[:, None]
        tl.atomic_add(ws_ptrs, acc, mask=y_mask, sem="relaxed")
        tl.debug_barrier()  # every thread's partial is in before the (releasing) count below
        tile = count_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        if tl.atomic_add(tile, 1, sem="acq_rel") == n_splits - 1:
            total = tl.load(ws_ptrs, mask=y_mask, other=0.0, cache_modifier=".cg")  # L2, where atomics add
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.store(ws_ptrs, tl.zeros_like(total), mask=y_mask)
            tl.store(tile, 0)


@triton.jit
def _deinterleave(x, R: tl.constexpr, T: tl.constexpr, V: tl.constexpr):
    """Split x [R, V * T] by position within a word: piece i [R, T] holds columns V t + i (V = 2 or 4;
    for V = 2 the pieces are returned twice). Register shuffles only: the tile is loaded contiguously."""
    if V == 4:
        even, odd = tl.split(tl.reshape(x, [R, T, 2, 2]))  # column V t + 2 a + b -> [t, a, b]
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        return x0, x1, x2, x3
    else:
        x0, x1 = tl.split(tl.reshape(x, [R, T, 2]))
        return x0, x1, x0, x1


@triton.jit
def _magic(h, i: tl.constexpr, BITS: tl.constexpr, MAGIC: tl.constexpr, dtype: tl.constexpr):
    """Value i of every int16 in h as the float ``BIAS + q`` (OR-ed into BIAS's mantissa, no conversion)."""
    return (((h >> (i * BITS)) & ((1 << BITS) - 1)) | MAGIC).to(tl.int16).to(dtype, bitcast=True)


@triton.jit
def _skinny_kernel(
    x_ptr,  # [M, K] activations (fp16/bf16)
    qw_ptr,  # [N, ceil(K / V)] int16 view of the packed int32 weight
    scale_ptr,  # [N, ceil(K / GROUP)]
    zero_ptr,  # [ceil(N / (32 // BITS)), ceil(K / GROUP)] int32 packed zero points (only when HAS_ZERO)
    y_ptr,  # [M, N]: the output dtype, or fp32 partial sums (MODE 1)
    ws_ptr,  # fp32 workspace, zero between calls (MODE 2)
    count_ptr,  # int32 arrivals per output tile, zero between calls (MODE 2)
    M,
    N,
    K,
    x_row_stride,
    qw_row_stride,
    scale_row_stride,
    zero_row_stride,
    y_row_stride,
    tiles_per_split,
    n_splits,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    MAGIC: tl.constexpr,  # bit pattern of BIAS in the activation dtype; 0: convert q (BIAS 0)
    BIAS: tl.constexpr,
    PRESCALE: tl.constexpr,  # dequantize each weight before the dot (groups narrower than a dot)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,  # how partial tiles meet: see _write_tile
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask along K, so the weight loads vectorize
    GPT: tl.constexpr,  # groups per K tile when groups align to tiles (1 for groups of whole tiles), else 0
    DOT_FP32: tl.constexpr,  # upcast the dot operands (Triton's interpreter gets bf16 tl.dot wrong)
):
    """y[m, n] = sum_k x[m, k] (q[n, k] - z[n, g]) s[n, g],  g = k // GROUP."""
    V: tl.constexpr = 16 // BITS  # values per int16
    T: tl.constexpr = BLOCK_K // V  # int16 per row of a tile
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_t = tl.arange(0, T)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    n_words = tl.cdiv(K, V)
    qw_rows = qw_ptr + offs_n[:, None].to(tl.int64) * qw_row_stride
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * x_row_stride
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    tile_begin = pid_k * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tl.cdiv(K, BLOCK_K))
    if GPT > 0:  # the next tile's scales are loaded one iteration ahead (too small for the pipeliner)
        s_next, z_next = _tile_params(scale_ptr, zero_ptr, offs_n, mask_n, tile_begin, K, scale_row_stride,
                                      zero_row_stride, BITS, GROUP, HAS_ZERO, BLOCK_K, GPT)  # fmt: skip
    for tile in range(tile_begin, tile_end):
        k0 = tile * BLOCK_K
        words = k0 // V + offs_t
        ks = k0 + offs_k
        if GPT > 0:
            s, z = _per_word(s_next, BLOCK_N, GPT, T), _per_word(z_next, BLOCK_N, GPT, T)  # [BN, 1 or T]
            following = tl.minimum(tile + 1, tile_end - 1)
            s_next, z_next = _tile_params(scale_ptr, zero_ptr, offs_n, mask_n, following, K, scale_row_stride,
                                          zero_row_stride, BITS, GROUP, HAS_ZERO, BLOCK_K, GPT)  # fmt: skip
        if EVEN_K:
            h = tl.load(qw_rows + words[None, :], mask=mask_n[:, None], other=0)
            xt = tl.load(x_rows + ks[None, :], mask=mask_m[:, None], other=0.0)
        else:
            h = tl.load(qw_rows + words[None, :], mask=mask_n[:, None] & (words < n_words)[None, :], other=0)
            xt = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & (ks < K)[None, :], other=0.0)
        xs = _deinterleave(xt, BLOCK_M, T, V)  # xs[i][:, t] = x[:, k0 + V t + i]
        part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for i in tl.static_range(V):
            xi = tl.trans(xs[i])  # [T, BLOCK_M]
            if MAGIC != 0:
                w = _magic(h, i, BITS, MAGIC, dtype)  # BIAS + q, exactly
            else:  # q through the fp32 magic 2**23 (exact), then one conversion
                q = (h.to(tl.int32) >> (i * BITS)) & MASK
                w = ((q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0).to(dtype)
            if PRESCALE:
                if GPT == 0:  # groups not aligned to tiles: the group of each value
                    k = k0 + offs_t * V + i
                    s, z = _group_params(scale_ptr, zero_ptr, offs_n[:, None], (k // GROUP)[None, :],
                                         mask_n[:, None] & (k < K)[None, :], scale_row_stride,
                                         zero_row_stride, BITS, HAS_ZERO)  # fmt: skip
                w = ((w.to(tl.float32) - (BIAS + z)) * s).to(dtype)
            if DOT_FP32:
                part = tl.dot(w.to(tl.float32), xi.to(tl.float32), part, input_precision="ieee")
            else:
                part = tl.dot(w, xi, part)
        if PRESCALE:
            acc += part
        else:  # the whole tile is in one group: s, z are [BLOCK_N, 1]
            xsum = tl.sum(xt.to(tl.float32), axis=1)
            acc += s * (part - (BIAS + z) * xsum[None, :])
    _write_tile(acc, y_ptr, ws_ptr, count_ptr, offs_n, offs_m, mask_n, mask_m, y_row_stride, n_splits, MODE)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K] activations
    qw_ptr,  # [N, ceil(K / V)] int16 view of the packed int32 weight
    scale_ptr,  # [N, ceil(K / GROUP)]
    zero_ptr,  # [ceil(N / (32 // BITS)), ceil(K / GROUP)] int32 packed zero points (only when HAS_ZERO)
    y_ptr,  # [M, N]: the output dtype, or fp32 partial sums (MODE 1)
    ws_ptr,  # fp32 workspace, zero between calls (MODE 2)
    count_ptr,  # int32 arrivals per output tile, zero between calls (MODE 2)
    M,
    N,
    K,
    x_row_stride,
    qw_row_stride,
    scale_row_stride,
    zero_row_stride,
    y_row_stride,
    tiles_per_split,
    n_splits,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,  # how partial tiles meet: see _write_tile
    EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,  # software-pipeline depth of the weight loads (1: none)
):
    """The skinny product on the FMA units, for a few rows: no tensor-core round trips, all in registers.

    A value q becomes the fp32 ``q`` with one OR (into the mantissa of 2**23) and one subtract; products
    accumulate per (row, output, word) in fp32 and the group's scale and zero point are applied per tile
    (``sum (q - z) s x = s (sum q x - z sum x)``); the word axis is summed once at the end.
    """
    V: tl.constexpr = 16 // BITS
    T: tl.constexpr = BLOCK_K // V
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_t = tl.arange(0, T)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    n_words = tl.cdiv(K, V)
    qw_rows = qw_ptr + offs_n[:, None].to(tl.int64) * qw_row_stride
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * x_row_stride
    acc = tl.zeros([BLOCK_N, BLOCK_M, T], dtype=tl.float32)
    tile_begin = pid_k * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for tile in tl.range(tile_begin, tile_end, num_stages=STAGES):
        k0 = tile * BLOCK_K
        words = k0 // V + offs_t
        if EVEN_K:
            h = tl.load(qw_rows + words[None, :], mask=mask_n[:, None], other=0)
        else:
            h = tl.load(qw_rows + words[None, :], mask=mask_n[:, None] & (words < n_words)[None, :], other=0)
        h = h.to(tl.int32)
        ks = k0 + offs_k
        if EVEN_K:
            xt = tl.load(x_rows + ks[None, :], mask=mask_m[:, None], other=0.0)
        else:
            xt = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & (ks < K)[None, :], other=0.0)
        xs = _deinterleave(xt.to(tl.float32), BLOCK_M, T, V)  # xs[i][:, t] = x[:, k0 + V t + i]
        part = tl.zeros([BLOCK_N, BLOCK_M, T], dtype=tl.float32)
        xsum = tl.zeros([BLOCK_M, T], dtype=tl.float32)
        for i in tl.static_range(V):
            q = (((h >> (i * BITS)) & MASK) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            part += q[:, None, :] * xs[i][None, :, :]
            xsum += xs[i]
        if GROUP % BLOCK_K == 0:  # one group for the whole tile: per-row scalars
            s, z = _group_params(scale_ptr, zero_ptr, offs_n[:, None], k0 // GROUP, mask_n[:, None],
                                 scale_row_stride, zero_row_stride, BITS, HAS_ZERO)  # fmt: skip
        else:  # several groups in the tile: the group of each word
            word_groups = ((k0 + offs_t * V) // GROUP)[None, :]
            word_mask = mask_n[:, None] & (words < n_words)[None, :]
            s, z = _group_params(scale_ptr, zero_ptr, offs_n[:, None], word_groups, word_mask,
                                 scale_row_stride, zero_row_stride, BITS, HAS_ZERO)  # fmt: skip
        acc += (part - z[:, None, :] * xsum[None, :, :]) * s[:, None, :]
    _write_tile(
        tl.sum(acc, axis=2),
        y_ptr,
        ws_ptr,
        count_ptr,
        offs_n,
        offs_m,
        mask_n,
        mask_m,
        y_row_stride,
        n_splits,
        MODE,
    )


@triton.jit
def _deinterleave8(x, R: tl.constexpr, W: tl.constexpr):
    """Split x [R, 8 W] by position within an int32 word: piece j [R, W] holds columns 8 t + j."""
    even, odd = tl.split(tl.reshape(x, [R, W, 2, 2, 2]))  # column 8 t + 4 c + 2 a + b -> [t, c, a, b]
    e0, e1 = tl.split(even)
    o0, o1 = tl.split(odd)
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e1)
    x1, x5 = tl.split(o0)
    x3, x7 = tl.split(o1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _gemv_int4_kernel(
    x_ptr,  # [M, K] activations
    qw_ptr,  # [N, ceil(K / 8)] packed int32 weight
    scale_ptr,  # [N, ceil(K / GROUP)]
    zero_ptr,  # [ceil(N / 8), ceil(K / GROUP)] int32 packed zero points (only when HAS_ZERO)
    y_ptr,  # [M, N]: the output dtype, or fp32 partial sums (MODE 1)
    ws_ptr,  # fp32 workspace, zero between calls (MODE 2)
    count_ptr,  # int32 arrivals per output tile, zero between calls (MODE 2)
    M,
    N,
    K,
    x_row_stride,
    qw_row_stride,
    scale_row_stride,
    zero_row_stride,
    y_row_stride,
    tiles_per_split,
    n_splits,
    GROUP: tl.constexpr,  # a multiple of 8: a word's values share a group
    GPT: tl.constexpr,  # groups per K tile when groups align to tiles (1 for groups of whole tiles), else 0
    HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,  # how partial tiles meet: see _write_tile
    EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,  # software-pipeline depth of the weight loads (1: none)
):
    """int4 on the FMA units, two values per integer instruction.

    Shifting a word by 4 i and masking with 0x000F000F leaves values i and i + 4 in the low bits of its
    two halves; OR-ing 0x43004300 makes each half the bf16 ``128 + q``, and each half becomes an fp32
    operand with one shift or mask (bf16 is the top half of fp32). Products ``(128 + q) x`` accumulate
    per (row, output, word) in fp32; per tile, ``sum (q - z) s x = s (sum (128 + q) x - (128 + z) sum x)``.
    """
    W: tl.constexpr = BLOCK_K // 8  # words per row of a tile
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_w = tl.arange(0, W)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    n_words = tl.cdiv(K, 8)
    qw_rows = qw_ptr + offs_n[:, None].to(tl.int64) * qw_row_stride
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * x_row_stride
    acc = tl.zeros([BLOCK_N, BLOCK_M, W], dtype=tl.float32)
    tile_begin = pid_k * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tl.cdiv(K, BLOCK_K))
    if GPT > 0:  # the next tile's scales are loaded one iteration ahead (too small for the pipeliner)
        s_next, z_next = _tile_params(scale_ptr, zero_ptr, offs_n, mask_n, tile_begin, K, scale_row_stride,
                                      zero_row_stride, 4, GROUP, HAS_ZERO, BLOCK_K, GPT)  # fmt: skip
    for tile in tl.range(tile_begin, tile_end, num_stages=STAGES):
        k0 = tile * BLOCK_K
        words = k0 // 8 + offs_w
        ks = k0 + offs_k
        if GPT > 0:
            s, z = _per_word(s_next, BLOCK_N, GPT, W), _per_word(z_next, BLOCK_N, GPT, W)
            following = tl.minimum(tile + 1, tile_end - 1)
            s_next, z_next = _tile_params(scale_ptr, zero_ptr, offs_n, mask_n, following, K, scale_row_stride,
                                          zero_row_stride, 4, GROUP, HAS_ZERO, BLOCK_K, GPT)  # fmt: skip
        else:  # groups not aligned to tiles: the group of each word
            word_groups = ((k0 + offs_w * 8) // GROUP)[None, :]
            word_mask = mask_n[:, None] & (words < n_words)[None, :]
            s, z = _group_params(scale_ptr, zero_ptr, offs_n[:, None], word_groups, word_mask,
                                 scale_row_stride, zero_row_stride, 4, HAS_ZERO)  # fmt: skip
        if EVEN_K:
            h = tl.load(qw_rows + words[None, :], mask=mask_n[:, None], other=0)
            xt = tl.load(x_rows + ks[None, :], mask=mask_m[:, None], other=0.0)
        else:
            h = tl.load(qw_rows + words[None, :], mask=mask_n[:, None] & (words < n_words)[None, :], other=0)
            xt = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & (ks < K)[None, :], other=0.0)
        xs = _deinterleave8(xt.to(tl.float32), BLOCK_M, W)  # xs[j][:, t] = x[:, k0 + 8 t + j]
        part = tl.zeros([BLOCK_N, BLOCK_M, W], dtype=tl.float32)
        for i in tl.static_range(4):
            pair = ((h >> (4 * i)) & 0x000F000F) | 0x43004300
            lo = (pair << 16).to(tl.float32, bitcast=True)  # 128 + value i
            hi = (pair & -65536).to(tl.float32, bitcast=True)  # 128 + value i + 4
            part += lo[:, None, :] * xs[i][None, :, :]
            part += hi[:, None, :] * xs[i + 4][None, :, :]
        xsum = xs[0] + xs[1] + xs[2] + xs[3] + xs[4] + xs[5] + xs[6] + xs[7]
        acc += (part - (128.0 + z)[:, None, :] * xsum[None, :, :]) * s[:, None, :]
    _write_tile(
        tl.sum(acc, axis=2),
        y_ptr,
        ws_ptr,
        count_ptr,
        offs_n,
        offs_m,
        mask_n,
        mask_m,
        y_row_stride,
        n_splits,
        MODE,
    )


@triton.jit
def _dequantize_kernel(
    qw_ptr,  # [N, ceil(K / PACK)] int32
    scale_ptr,
    zero_ptr,
    w_ptr,  # [N, K] out, activation dtype
    N,
    K,
    qw_row_stride,
    scale_row_stride,
    zero_row_stride,
    w_row_stride,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """W[n, k] = ((q - z) * s) in fp32, rounded once to the output dtype (compressed-tensors' formula)."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    rows = offs_n[:, None].to(tl.int64)
    word = tl.load(qw_ptr + rows * qw_row_stride + (offs_k // PACK)[None, :], mask=mask, other=0)
    q = (word >> ((offs_k % PACK) * BITS)[None, :]) & MASK
    s, z = _group_params(scale_ptr, zero_ptr, offs_n[:, None], (offs_k // GROUP)[None, :], mask,
                         scale_row_stride, zero_row_stride, BITS, HAS_ZERO)  # fmt: skip
    w = (q.to(tl.float32) - z) * s
    tl.store(w_ptr + rows * w_row_stride + offs_k[None, :], w.to(w_ptr.dtype.element_ty), mask=mask)


def check_inputs(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bits: int,
) -> None:
    if bits not in quant_layout.SUPPORTED_BITS:
        raise ValueError(f"quant_matmul: bits must be one of {quant_layout.SUPPORTED_BITS}, got {bits}")
    if group_size < 1:
        raise ValueError(f"quant_matmul: group_size must be positive, got {group_size}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"quant_matmul: x must be fp16, bf16 or fp32, got {x.dtype}")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(
            f"quant_matmul: qweight must be int32 [N, K/{32 // bits}], got {qweight.dtype} "
            f"{tuple(qweight.shape)}"
        )
    n_out, k_in = qweight.shape[0], x.shape[-1]
    per_word = 32 // bits
    if qweight.shape[1] != -(-k_in // per_word):
        raise ValueError(
            f"quant_matmul: qweight has {qweight.shape[1]} words per row; K={k_in} at {bits} bits "
            f"needs {-(-k_in // per_word)}"
        )
    n_groups = -(-k_in // group_size)
    if tuple(scales.shape) != (n_out, n_groups):
        raise ValueError(f"quant_matmul: scales must be [{n_out}, {n_groups}], got {tuple(scales.shape)}")
    if zeros is not None and tuple(zeros.shape) != (-(-n_out // per_word), n_groups):
        raise ValueError(
            f"quant_matmul: zeros must be int32 [{-(-n_out // per_word)}, {n_groups}], "
            f"got {tuple(zeros.shape)}"
        )


_WORKSPACES: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list[tuple[torch.Tensor, torch.Tensor]] = []


def _workspace(device: torch.device, numel: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's split-K workspace (fp32 partial sums, int32 tile counters), zero between calls: every
    kernel zeroes what it used (``_write_tile`` MODE 2). Grown on demand; a replaced one is kept alive,
    as CUDA graphs captured earlier still point at it. Kernels on one stream run one after another; two
    streams running quant_matmul at once on one device would share it (serving engines use one)."""
    key = (device.type, device.index)
    ws, counts = _WORKSPACES.get(key, (None, None))
    if ws is None or ws.numel() < numel or counts.numel() < tiles:
        if ws is not None:
            _RETIRED.append((ws, counts))
        ws = torch.zeros(max(numel, 1 << 20), dtype=torch.float32, device=device)
        counts = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _WORKSPACES[key] = (ws, counts)
    return ws, counts


def _tile_k(group_size: int, k_in: int, bits: int) -> tuple[int, bool]:
    """(BLOCK_K, prescale) for the tensor-core kernel: the widest tile of at most 256 inside one group,
    else a PRESCALE tile: 256 (or K, if narrower) when whole groups tile it, else 64. A dot needs depth
    >= 16, so a tile holds at least 16 int16 words: 64 int4 / 32 int8 values."""
    per16 = 16 // bits
    min_k = 16 * per16
    span = min(group_size, next_power_of_2(k_in))  # a group wider than K behaves like K
    for block_k in (256, 128, 64, 32):
        if min_k <= block_k <= span and group_size % block_k == 0:
            return block_k, False
    block_k = max(min_k, min(256, next_power_of_2(k_in)))
    if block_k % group_size or group_size % per16:  # groups straddle tiles: per-value scale gathers
        block_k = max(min_k, 64)  # (a 256-deep tile of gathers would not fit in shared memory)
    return block_k, True


def _groups_per_tile(group_size: int, block_k: int, per_word: int) -> int:
    """GPT of the kernels: 1 when a group holds whole K tiles, BLOCK_K / G when whole groups tile a K
    tile (and a group holds whole words), 0 when groups straddle tiles (scales gathered per value)."""
    if group_size % block_k == 0:
        return 1
    if block_k % group_size == 0 and group_size % per_word == 0:
        return block_k // group_size
    return 0


def tuning(kernel: str, m: int, n_out: int, k_in: int, block_k: int, device: torch.device) -> dict:
    """BLOCK_N, split-K, warps and stages for the decode kernels, from the H100 sweep
    (tests/benchmarks/bench_quant_matmul.py --sweep, 4096 / 14336 shapes, 1-64 rows): 128-wide tiles,
    4 warps, 3 stages and 8 K splits were within a few percent of each shape's best; 16 splits when the
    N tiles alone fill few SMs and K is long (4096 x 14336: 16 splits, 24.5 vs 25.5 us at 16 rows)."""
    tiles = cdiv(k_in, block_k)
    if interpreting():  # small tiles; split-K whenever there are two tiles, so the tests cover both paths
        return {"BLOCK_N": 16, "split": min(2, tiles), "num_warps": 4, "num_stages": 1}
    block_n = 128
    few_tiles = cdiv(n_out, block_n) * 8 < 2 * sm_count(device)
    split = 16 if few_tiles and tiles >= 64 else 8
    return {"BLOCK_N": block_n, "split": max(1, min(split, tiles)), "num_warps": 4, "num_stages": 3}


def _quant_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    check_inputs(x, qweight, scales, zeros, group_size, bits)
    if use_reference(x) or x.dtype == torch.float32:
        # fp32 activations have no tensor-core path worth a kernel; they run the reference everywhere.
        return reference.quant_matmul(x, qweight, scales, zeros, group_size, bits)
    n_out, k_in = qweight.shape[0], x.shape[-1]
    x2 = x.reshape(-1, k_in)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    qweight, scales = qweight.contiguous(), scales.contiguous()
    zero_arg = zeros.contiguous() if zeros is not None else qweight
    if m > SKINNY_MAX_M:
        weight = dequantize(qweight, scales, zeros, k_in, group_size, bits, x.dtype)
        return (x2 @ weight.t()).reshape(*x.shape[:-1], n_out)
    per16 = 16 // bits
    gemv = m <= GEMV_MAX_M and group_size % per16 == 0
    pairs = gemv and bits == 4 and group_size % 8 == 0  # the int4 FMA kernel reads whole int32 words
    if gemv:
        kernel = _gemv_int4_kernel if pairs else _gemv_kernel
        block_m, prescale = next_power_of_2(m), False
        block_k = 256 if group_size % 256 == 0 else 128
        cfg = tuning("gemv", m, n_out, k_in, block_k, x.device)
    else:
        kernel, block_m = _skinny_kernel, (16 if m <= 16 else (32 if m <= 32 else 64))
        block_k, prescale = _tile_k(group_size, k_in, bits)
        cfg = tuning("mma", m, n_out, k_in, block_k, x.device)
    magic, bias, mantissa = _MAGIC[x.dtype]
    if bits >= mantissa:  # int8 values do not fit bf16's 7-bit mantissa: converted instead (BIAS 0)
        magic, bias = 0, 0.0
    tiles = cdiv(k_in, block_k)
    tiles_per_split = cdiv(tiles, cfg["split"])
    split = cdiv(tiles, tiles_per_split)
    grid = (cdiv(n_out, cfg["BLOCK_N"]), cdiv(m, block_m), split)
    # Split-K partials meet in a self-cleaning workspace (one launch) unless torch may be tracing the
    # launch (the workspace is state outside the op's inputs): then in a zeroed fp32 y, cast afterwards.
    mode = 0 if split == 1 else (2 if eager(x, qweight, scales, zeros) else 1)
    y = (torch.zeros if mode == 1 else torch.empty)((m, n_out), dtype=torch.float32 if mode == 1 else x.dtype,
                                                     device=x.device)  # fmt: skip
    ws, counts = _workspace(x.device, m * n_out, grid[0] * grid[1]) if mode == 2 and m else (y, y)
    if m:
        words, word_stride = (
            (qweight, qweight.stride(0)) if pairs else (qweight.view(torch.int16), qweight.stride(0) * 2)
        )
        args = (
            x2, words, scales, zero_arg, y, ws, counts, m, n_out, k_in,
            x2.stride(0), word_stride, scales.stride(0), zero_arg.stride(0), y.stride(0),
            tiles_per_split, split,
        )  # fmt: skip
        meta = {"GROUP": group_size, "HAS_ZERO": zeros is not None, "BLOCK_M": block_m,
                "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": block_k, "MODE": mode,
                "EVEN_K": k_in % block_k == 0, "num_warps": cfg["num_warps"],
                "num_stages": cfg["num_stages"]}  # fmt: skip
        if not pairs:
            meta["BITS"] = bits
        if gemv:
            meta["STAGES"] = cfg["num_stages"]
            if pairs:
                meta["GPT"] = _groups_per_tile(group_size, block_k, 8)
        else:
            meta |= {"MAGIC": magic, "BIAS": bias, "PRESCALE": prescale,
                     "GPT": _groups_per_tile(group_size, block_k, per16),
                     "DOT_FP32": interpreting() and x.dtype == torch.bfloat16}  # fmt: skip
        traceable(kernel)[grid](*args, **meta)
    return y.to(x.dtype).reshape(*x.shape[:-1], n_out)


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    k_in: int,
    group_size: int,
    bits: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The dense [N, K] weight in ``dtype``, expanded by :func:`_dequantize_kernel` (bit-exact)."""
    n_out = qweight.shape[0]
    weight = torch.empty((n_out, k_in), dtype=dtype, device=qweight.device)
    zero_arg = zeros if zeros is not None else qweight
    block_n, block_k = (16, 64) if interpreting() else (32, 256)
    grid = (cdiv(n_out, block_n), cdiv(k_in, block_k))
    traceable(_dequantize_kernel)[grid](
        qweight, scales, zero_arg, weight, n_out, k_in,
        qweight.stride(0), scales.stride(0), zero_arg.stride(0), weight.stride(0),
        BITS=bits, GROUP=group_size, HAS_ZERO=zeros is not None, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return weight


quant_matmul = triton_op("squeezeserve::quant_matmul", _quant_matmul, mutates_args=())


@quant_matmul.register_fake
def _(x, qweight, scales, zeros, group_size, bits):
    check_inputs(x, qweight, scales, zeros, group_size, bits)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@torch.library.custom_op("squeezeserve::quant_matmul_opaque", mutates_args=())
def quant_matmul_opaque(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """``quant_matmul`` as an opaque op: torch.compile does not trace into it, so the row-count dispatch
    (FMA / tensor-core / dequantize + cuBLAS) runs on every call. For engines that compile one graph for a
    range of token counts (vLLM): traced through, the dispatch would be fixed at the trace's size (vLLM
    traces at its largest batch, which took the prefill path for every decode step). No autograd: serving.
    """
    return _quant_matmul(x, qweight, scales, zeros, group_size, bits)


@quant_matmul_opaque.register_fake
def _(x, qweight, scales, zeros, group_size, bits):
    check_inputs(x, qweight, scales, zeros, group_size, bits)
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def _setup(ctx, inputs, output):
    x, qweight, scales, zeros, group_size, bits = inputs
    ctx.save_for_backward(qweight, scales, zeros)
    ctx.meta = (x.shape[-1], group_size, bits, x.dtype)


def _grad(ctx, grad):
    """Weights are frozen: only dx = grad @ dequantize(W)."""
    qweight, scales, zeros = ctx.saved_tensors
    k_in, group_size, bits, dtype = ctx.meta
    weight = quant_layout.dequantize(qweight, scales, zeros, (qweight.shape[0], k_in), group_size, bits)
    return grad @ weight.to(dtype), None, None, None, None, None


quant_matmul.register_autograd(_grad, setup_context=_setup)
