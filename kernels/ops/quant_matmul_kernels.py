"""quant_matmul's Triton kernels: ``y = x @ dequantize(W).T`` over compressed-tensors' pack-quantized layout.

How they are chosen, tuned, launched and registered is in ``quant_matmul.py``.

The layout is defined once, in ``kernels/quant_layout.py``: ``qweight`` int32 [N, ceil(K / P)] packed
along K (P = 32 // bits, lowest bits first, offset-binary), ``scales`` [N, ceil(K / G)], optional
``zeros`` int32 [ceil(N / P), ceil(K / G)] packed along N.

Decode and batched decode (M <= SKINNY_MAX_M) stream the packed weight with as little arithmetic per
weight as possible: one row of int4 (groups of whole words; two for groups of at most 64) on the FMA units
(:func:`_gemv_int4_kernel`), everything else on tensor cores (:func:`_skinny_kernel`; int8 at one row too,
where it beat an int8 FMA kernel at every shape measured, tests/benchmarks/NOTES.md):

- Wide, pipelined loads: when K is a multiple of the tile (``EVEN_K``) no K mask is applied, so the weight
  tile loads are 16-byte vectors that Triton turns into multi-stage ``cp.async`` pipelines (with a mask of
  unknown alignment they were one int16 per instruction and not pipelined). The activation tile is loaded
  contiguously and split by position within a word in registers (:func:`_deinterleave`).
- Swapped operands: each program computes ``acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile.T``, so the weight,
  the big operand, is the MMA's A operand in its stored K-major order, and the few activation rows are B.
- No unpacking reshape: the packed words are taken as int16 halves (4 int4 / 2 int8 values each, value k
  of a row in half ``k // V``, position ``k % V``). Position ``i`` of every half in a tile is one
  [BLOCK_N, T] operand whose columns are k = V t + i; it meets the activations at the same k. V dots of
  depth T = BLOCK_K / V replace one dot of depth BLOCK_K. The words are loaded and masked as int32, so
  one shift and one LOP3 make position i of both halves of a word (:func:`_magic`); read as int16 the
  kernel spent a shift a value and a PRMT a pair re-packing them: 22-45% more instructions in its K
  loop (sm_90 SASS) and 4-30% more time at 4-32 rows on the H100 (tests/benchmarks/NOTES.md).
- No conversion instructions (int-to-float runs at 1/8 of the FMA rate and would bound the kernel): a value
  q is turned into the float ``BIAS + q`` by OR-ing it into the mantissa of ``BIAS`` (0x4300 = 128.0 in
  bf16, 0x6400 = 1024.0 in fp16; exact since q < 2**7 resp. 2**10), then bitcast: two values per
  instruction (``0x43004300`` over an int32 word), in both kernels. int8 with bf16 activations (q up to 255
  does not fit) goes through the fp32 magic 2**23 and one conversion.
- Scale and zero point after the dot: a tile is one quantization group, so
  ``sum_k (q - z) s x = s * (sum_k (BIAS + q) x - (BIAS + z) * sum_k x)``; the correction is per (row, group).
  Groups narrower than a dot's minimum depth (int4 with G < 64, or G not a multiple of V) take the PRESCALE
  form instead: w = (q - z) * s per weight, then the dot. When the scales are in the activation dtype
  (``NATIVE``) that is two operations in that dtype, ``((BIAS + q) - (BIAS + z)) * s``: the difference is
  an exact small integer and the product rounds once, as the fp32 form's final cast does, so the result is
  the same; it runs 1.07-1.24x faster on the H100 than converting to fp32 and back. (int4 groups of 32
  read as bytes, V = 2, so that a dot of depth 16 stays inside a group and the scale comes after it, ran
  1.4-1.7x slower than this: results/g32_probe_h100_2026-11-24.log.) Scales are loaded one tile ahead, as
  one [BLOCK_N, groups per tile] block when groups tile the K tile (:func:`_tile_params`).
- Split-K across programs when N alone gives too few programs to fill the GPU: partial tiles meet in a
  self-cleaning fp32 workspace (:func:`_write_tile`).

Prefill (M > SKINNY_MAX_M) is compute-bound: :func:`_prefill_kernel` is a tensor-core GEMM that
dequantizes the weight tile in registers; :func:`_dequantize_kernel` expands W to the activation dtype once
(bit-exact, as compressed-tensors dequantizes) for cuBLAS. ``quant_matmul.PREFILL`` says which runs where.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The kernels keep their leading underscore: it is the name profilers show and tests/gpu/vllm_ab.py counts.


@triton.jit
def _group_params(scale_ptr, zero_ptr, rows, g, mask, scale_row_stride, zero_row_stride, BITS: tl.constexpr,
                  HAS_ZERO: tl.constexpr, ZERO_ROWS: tl.constexpr = False):  # fmt: skip
    """(scale, zero point) in fp32 of output rows ``rows`` in groups ``g`` (broadcast against each other).

    Zero points are packed along N (``32 // BITS`` rows per int32), or with ``ZERO_ROWS`` along the groups
    (quant_layout.to_owned_zeros: a row's ``32 // BITS`` groups a word); without them the zero point is the
    offset-binary midpoint ``2**(BITS-1)``.
    """
    PACK: tl.constexpr = 32 // BITS
    s = tl.load(scale_ptr + rows.to(tl.int64) * scale_row_stride + g, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZERO and ZERO_ROWS:
        zw = tl.load(zero_ptr + rows * zero_row_stride + g // PACK, mask=mask, other=0)
        z = ((zw >> ((g % PACK) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
    elif HAS_ZERO:
        zw = tl.load(zero_ptr + (rows // PACK) * zero_row_stride + g, mask=mask, other=0)
        z = ((zw >> ((rows % PACK) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
    else:
        z = tl.zeros_like(s) + (1 << (BITS - 1))
    return s, z


@triton.jit
def _tile_params(scale_ptr, zero_ptr, offs_n, mask_n, tile, K, scale_row_stride, zero_row_stride,
                 BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_K: tl.constexpr,
                 GPT: tl.constexpr, ZERO_ROWS: tl.constexpr = False):  # fmt: skip
    """(scale, zero point) [BLOCK_N, GPT] of the GPT groups that K tile ``tile`` spans (groups aligned to
    tiles: GPT = BLOCK_K / GROUP, or 1 when a group holds whole tiles)."""
    groups = (tile * BLOCK_K) // GROUP + tl.arange(0, GPT)
    mask = mask_n[:, None] & (groups < tl.cdiv(K, GROUP))[None, :]
    return _group_params(scale_ptr, zero_ptr, offs_n[:, None], groups[None, :], mask, scale_row_stride,
                         zero_row_stride, BITS, HAS_ZERO, ZERO_ROWS)  # fmt: skip


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
            tl.debug_barrier()
            # The sums are read with atomics (strong reads at L2, where the adds happened). A plain load,
            # even ".cg", missed other programs' partial sums on the H100: 1-35% of launches off by up to
            # 0.2 (relative) at 3-12 rows; with atomic reads none in 2,000 (tests/gpu/splitk_probe.py,
            # 2026-11-23), at the old speed (quant_matmul median 1.00x, worst 1.05x over 38 shapes).
            total = tl.atomic_add(ws_ptrs, tl.zeros_like(acc), mask=y_mask, sem="relaxed")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.store(ws_ptrs, tl.zeros_like(total), mask=y_mask)
            tl.store(tile, 0)


@triton.jit
def _load_tile(qw_rows, x_rows, words, ks, mask_n, mask_m, n_words, K, EVEN_K: tl.constexpr):
    """One K tile: the weight words ``words`` of rows ``qw_rows`` and the activations at ``ks`` of rows
    ``x_rows``, zero outside. With ``EVEN_K`` (K a multiple of the tile) no K mask: the loads vectorize."""
    if EVEN_K:
        h = tl.load(qw_rows + words[None, :], mask=mask_n[:, None], other=0)
        xt = tl.load(x_rows + ks[None, :], mask=mask_m[:, None], other=0.0)
    else:
        h = tl.load(qw_rows + words[None, :], mask=mask_n[:, None] & (words < n_words)[None, :], other=0)
        xt = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & (ks < K)[None, :], other=0.0)
    return h, xt


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
def _halves(p, R: tl.constexpr, T: tl.constexpr):
    """int32 [R, T / 2] -> int16 [R, T]: each word's low half, then its high half (their order in memory)."""
    return tl.reshape(tl.join(p.to(tl.int16), (p >> 16).to(tl.int16)), [R, T])


@triton.jit
def _magic(h, i: tl.constexpr, BITS: tl.constexpr, MAGIC: tl.constexpr, dtype: tl.constexpr, R: tl.constexpr,
           T: tl.constexpr):  # fmt: skip
    """Value i of both int16 halves of every int32 word in h [R, T / 2] as the float ``BIAS + q``, [R, T]:
    OR-ed into BIAS's mantissa two at a time (one shift, one LOP3 a word), no conversion."""
    p = ((h >> (i * BITS)) & (((1 << BITS) - 1) * 0x10001)) | (MAGIC * 0x10001)
    return _halves(p, R, T).to(dtype, bitcast=True)


@triton.jit
def _offset(h, i: tl.constexpr, BITS: tl.constexpr, zz, dtype: tl.constexpr, R: tl.constexpr,
            T: tl.constexpr):  # fmt: skip
    """As :func:`_magic`, with the zero point taken off as an integer: ``zz`` holds ``MAGIC + OFF - z`` in
    both halves of each word (OFF = 2**BITS keeps the mantissa positive), so the floats are
    ``BIAS + OFF + q - z``, exact. The int32 add keeps each word's two halves in one register; subtracting
    a zero point [R, T] in the float dtype made Triton swap every pair's halves back and forth (two PRMT a
    pair in the sm_90 SASS: 661 instructions a K tile against 559 this way, g32 with zero points)."""
    p = ((h >> (i * BITS)) & (((1 << BITS) - 1) * 0x10001)) + zz
    return _halves(p, R, T).to(dtype, bitcast=True)


@triton.jit
def _exact_float(q, dtype: tl.constexpr):
    """Non-negative integers q < 2**23 (int32) as floats of ``dtype``: OR-ed into the fp32 magic 2**23, then
    one conversion (int-to-float instructions run at 1/8 of the FMA rate)."""
    return ((q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0).to(dtype)


@triton.jit
def _gathered_params(scale_ptr, zero_ptr, offs_n, mask_n, ks, K, scale_row_stride, zero_row_stride,
                     dtype: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                     BIAS: tl.constexpr, NATIVE: tl.constexpr):  # fmt: skip
    """(scale, zero point) of each value at K columns ``ks`` of rows ``offs_n`` (groups straddling tiles),
    in the form :func:`_dequant` takes."""
    s, z = _group_params(scale_ptr, zero_ptr, offs_n[:, None], (ks // GROUP)[None, :],
                         mask_n[:, None] & (ks < K)[None, :], scale_row_stride, zero_row_stride, BITS,
                         HAS_ZERO)  # fmt: skip
    if NATIVE:
        s, z = s.to(dtype), (BIAS + z).to(dtype)
    return s, z


@triton.jit
def _dequant(w, s, z, dtype: tl.constexpr, BITS: tl.constexpr, BIAS: tl.constexpr, OFFSET: tl.constexpr,
             NATIVE: tl.constexpr):  # fmt: skip
    """``(q - z) * s`` rounded once to ``dtype``, from w = ``BIAS + q`` (``BIAS + OFF + q - z`` with
    ``OFFSET``, OFF = 2**BITS). With ``NATIVE`` s and ``BIAS + z`` are in ``dtype``: the difference is an
    exact small integer and the product rounds once, as the fp32 form's final cast does."""
    if OFFSET:  # (BIAS + OFF + q - z) - (BIAS + OFF): exact
        return (w - (BIAS + (1 << BITS))) * s
    elif NATIVE:
        return (w - z) * s
    else:
        return ((w.to(tl.float32) - (BIAS + z)) * s).to(dtype)


@triton.jit
def _skinny_kernel(
    x_ptr,  # [M, K] activations (fp16/bf16)
    qw_ptr,  # [N, ceil(K / (2 V))] the packed int32 weight
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
    NATIVE: tl.constexpr,  # PRESCALE in the activation dtype (the scales are in it): see the module doc
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,  # how partial tiles meet: see _write_tile
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask along K, so the weight loads vectorize
    GPT: tl.constexpr,  # groups per K tile when groups align to tiles (1 for groups of whole tiles), else 0
    DOT_FP32: tl.constexpr,  # upcast the dot operands (Triton's interpreter gets bf16 tl.dot wrong)
    LAUNCH_DEPENDENTS: tl.constexpr = False,  # launch.launches_dependents: a PDL dependent may start now
):
    """y[m, n] = sum_k x[m, k] (q[n, k] - z[n, g]) s[n, g],  g = k // GROUP."""
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    V: tl.constexpr = 16 // BITS  # values per int16 half of a word
    T: tl.constexpr = BLOCK_K // V  # int16 halves per row of a tile
    MASK: tl.constexpr = (1 << BITS) - 1
    OFF: tl.constexpr = 1 << BITS  # keeps OFF + q - z positive (PRESCALE in the activation dtype)
    # Zero points per group taken off as integers (_offset) where each weight is dequantized in the
    # activation dtype.
    OFFSET: tl.constexpr = MAGIC != 0 and PRESCALE and NATIVE and GPT > 0 and HAS_ZERO
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_w = tl.arange(0, T // 2)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    n_words = tl.cdiv(K, 2 * V)
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
        words = k0 // (2 * V) + offs_w
        ks = k0 + offs_k
        if GPT > 0:
            if PRESCALE and NATIVE:  # in the activation dtype, BIAS folded into z (exact)
                s = _per_word(s_next.to(dtype), BLOCK_N, GPT, T)
                if OFFSET:  # z as MAGIC + OFF - z in both halves of each word, added to q in BIAS's mantissa
                    z = _per_word(((MAGIC + OFF) - z_next.to(tl.int32)) * 0x10001, BLOCK_N, GPT, T // 2)
                else:
                    z = _per_word((BIAS + z_next).to(dtype), BLOCK_N, GPT, T)
            else:
                s, z = _per_word(s_next, BLOCK_N, GPT, T), _per_word(z_next, BLOCK_N, GPT, T)  # [BN, 1 or T]
            following = tl.minimum(tile + 1, tile_end - 1)
            s_next, z_next = _tile_params(scale_ptr, zero_ptr, offs_n, mask_n, following, K, scale_row_stride,
                                          zero_row_stride, BITS, GROUP, HAS_ZERO, BLOCK_K, GPT)  # fmt: skip
        h, xt = _load_tile(qw_rows, x_rows, words, ks, mask_n, mask_m, n_words, K, EVEN_K)
        xs = _deinterleave(xt, BLOCK_M, T, V)  # xs[i][:, t] = x[:, k0 + V t + i]
        part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for i in tl.static_range(V):
            xi = tl.trans(xs[i])  # [T, BLOCK_M]
            if OFFSET:
                w = _offset(h, i, BITS, z, dtype, BLOCK_N, T)  # BIAS + OFF + q - z, exactly
            elif MAGIC != 0:
                w = _magic(h, i, BITS, MAGIC, dtype, BLOCK_N, T)  # BIAS + q, exactly
            else:  # q through the fp32 magic 2**23 (exact), then one conversion
                w = _exact_float(_halves(h >> (i * BITS), BLOCK_N, T).to(tl.int32) & MASK, dtype)
            if PRESCALE:
                if GPT == 0:  # groups not aligned to tiles: the group of each value
                    k = k0 + tl.arange(0, T) * V + i
                    s, z = _gathered_params(scale_ptr, zero_ptr, offs_n, mask_n, k, K, scale_row_stride,
                                            zero_row_stride, dtype, BITS, GROUP, HAS_ZERO, BIAS,
                                            NATIVE)  # fmt: skip
                w = _dequant(w, s, z, dtype, BITS, BIAS, OFFSET, NATIVE)
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
    zero_ptr,  # [ceil(N / 8), ceil(K / GROUP)] int32 packed zero points (only when HAS_ZERO; OWNED: [N, ...])
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
    OWNED: tl.constexpr = False,  # owned weights (quant_layout: to_owned_order's words, to_owned_zeros'
    # zero points): x is read in the words' order
    LAUNCH_DEPENDENTS: tl.constexpr = False,  # launch.launches_dependents: a PDL dependent may start now
):
    """int4 on the FMA units, two values per integer instruction.

    Shifting a word by 4 i and masking with 0x000F000F leaves values i and i + 4 in the low bits of its
    two halves; OR-ing 0x43004300 makes each half the bf16 ``128 + q``, and each half becomes an fp32
    operand with one shift or mask (bf16 is the top half of fp32). Products ``(128 + q) x`` accumulate
    per (row, output, word) in fp32; per tile, ``sum (q - z) s x = s (sum (128 + q) x - (128 + z) sum x)``.
    """
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
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
                                      zero_row_stride, 4, GROUP, HAS_ZERO, BLOCK_K, GPT, OWNED)  # fmt: skip
    for tile in tl.range(tile_begin, tile_end, num_stages=STAGES):
        k0 = tile * BLOCK_K
        words = k0 // 8 + offs_w
        ks = k0 + offs_k
        if GPT > 0:
            s, z = _per_word(s_next, BLOCK_N, GPT, W), _per_word(z_next, BLOCK_N, GPT, W)
            following = tl.minimum(tile + 1, tile_end - 1)
            s_next, z_next = _tile_params(scale_ptr, zero_ptr, offs_n, mask_n, following, K,
                                          scale_row_stride, zero_row_stride, 4, GROUP, HAS_ZERO, BLOCK_K, GPT,
                                          OWNED)  # fmt: skip
        else:  # groups not aligned to tiles: the group of each word
            word_groups = ((k0 + offs_w * 8) // GROUP)[None, :]
            word_mask = mask_n[:, None] & (words < n_words)[None, :]
            s, z = _group_params(scale_ptr, zero_ptr, offs_n[:, None], word_groups, word_mask,
                                 scale_row_stride, zero_row_stride, 4, HAS_ZERO, OWNED)  # fmt: skip
        h, xt = _load_tile(qw_rows, x_rows, words, ks, mask_n, mask_m, n_words, K, EVEN_K)
        if OWNED:  # each activation where the owned words hold its value, in registers (the loads stay whole)
            xt = _to_owned(xt, BLOCK_M, BLOCK_K)
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
def _unpack(h, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BITS: tl.constexpr):
    """Packed words h [BLOCK_N, BLOCK_K / PACK] -> their values q [BLOCK_N, BLOCK_K] (k = PACK w + j), in
    registers: each word is loaded once."""
    shifts = tl.arange(0, 32 // BITS) * BITS
    return tl.reshape((h[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1), [BLOCK_N, BLOCK_K])


@triton.jit
def _value_params(scale_ptr, zero_ptr, offs_n, mask_n, tile, ks, K, scale_row_stride, zero_row_stride,
                  BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GPT: tl.constexpr, ZERO_ROWS: tl.constexpr = False):  # fmt: skip
    """(scale, zero point) of every value of K tile ``tile`` (columns ``ks``), broadcastable to [BLOCK_N,
    BLOCK_K]: one [BLOCK_N, GPT] load when groups align to the tile, else a gather per value."""
    if GPT > 0:
        s, z = _tile_params(scale_ptr, zero_ptr, offs_n, mask_n, tile, K, scale_row_stride, zero_row_stride,
                            BITS, GROUP, HAS_ZERO, BLOCK_K, GPT, ZERO_ROWS)  # fmt: skip
        return _per_word(s, BLOCK_N, GPT, BLOCK_K), _per_word(z, BLOCK_N, GPT, BLOCK_K)
    else:
        return _group_params(scale_ptr, zero_ptr, offs_n[:, None], (ks // GROUP)[None, :],
                             mask_n[:, None] & (ks < K)[None, :], scale_row_stride, zero_row_stride, BITS,
                             HAS_ZERO, ZERO_ROWS)  # fmt: skip


@triton.jit
def _mma(a, b, acc, DOT_FP32: tl.constexpr):
    """acc + a @ b on tensor cores (in fp32 under the interpreter, whose bf16 tl.dot is wrong)."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _after_mma(h, TRACED: tl.constexpr):
    """h, once every tensor-core product this warpgroup has in flight is complete (``wgmma.wait_group 0``).

    The prefill GEMM's A operand is computed in registers every K tile. Triton (3.6) lets those products run
    on asynchronously across loop iterations, but the registers the next tile's weights are written to may
    still be read by them (PTX: undefined): on the H100 the tilings where ptxas kept them in flight gave
    products off by 0.45-16% (relative error against cuBLAS). Routing the next tile's words through this
    wait orders every write after it; the products of one tile still run back to back. Hopper only (wgmma
    is sm_90's instruction).

    ``TRACED``: a launch torch.compile traces (quant_matmul.COMPILED "kernels" on Hopper). torch reads which
    arguments a kernel writes off its TTIR and gives up at inline PTX not marked pure: it takes every
    argument as written, and aot_eager copies each, the weight too, every call (512 x 14336 x 4096 1.48x the
    GPU time; Inductor's graph 1.12-1.17x at 200-512 rows; NOTES.md, forty-third session). There the wait
    is marked pure: each of its instances (one for ``pack`` words) then may sink to the values it feeds, but
    every value made from this tile's words still comes after a wait (more waits in the SASS, each after the
    first for nothing). Eager launches keep one place for all."""
    return tl.inline_asm_elementwise(
        # (no escapes: Inductor copies a traced kernel's source, and its escapes broke the string there)
        "wgmma.wait_group.sync.aligned 0; mov.b32 $0, $4; mov.b32 $1, $5; mov.b32 $2, $6; mov.b32 $3, $7;",
        "=r,=r,=r,=r,r,r,r,r",
        [h],
        dtype=tl.int32,
        is_pure=TRACED,
        pack=4,
    )


@triton.jit
def _tile_weight(h, s_t, z_t, k0, offs_k, offs_n, mask_n, K, scale_ptr, zero_ptr, scale_row_stride,
                 zero_row_stride, dtype: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                 HAS_ZERO: tl.constexpr, MAGIC: tl.constexpr, BIAS: tl.constexpr, NATIVE: tl.constexpr,
                 GPT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The K tile of words h [BLOCK_N, W] dequantized, ``(q - z) * s``, as one dot's A operand [BLOCK_N,
    BLOCK_K] (``offs_k``: its K offsets). Values 2 p and 2 p + 1 of a word (adjacent in K) land in one int32
    register, low and high half, as [BLOCK_N, W, P, 2] -> [BLOCK_N, BLOCK_K] lays them out: one A-operand
    fragment register as the tensor cores take it (each thread holds pairs 2 c, 2 c + 1 of a 16-deep slice).
    Triton then loads each thread's words from shared memory straight into that layout, the four threads
    that share a word each taking their pair of it, with no shared-memory trip for the dequantized tile.
    ``s_t, z_t`` [BLOCK_N, GPT]: the tile's groups (fp32); with GPT == 0 (groups straddling tiles) they are
    gathered per value instead."""
    PACK: tl.constexpr = 32 // BITS
    P: tl.constexpr = PACK // 2  # value pairs a word
    W: tl.constexpr = BLOCK_K // PACK
    MASK: tl.constexpr = (1 << BITS) - 1
    OFF: tl.constexpr = 1 << BITS  # keeps OFF + q - z positive (OFFSET)
    # Zero points of whole-word groups taken off as integers in the mantissa (as _offset).
    OFFSET: tl.constexpr = MAGIC != 0 and NATIVE and GPT > 0 and HAS_ZERO
    shift = (tl.arange(0, P) * (2 * BITS))[None, None, :]  # value 2 p of a word at bit 0
    hw = h[:, :, None]
    pairs = ((hw >> shift) & MASK) | (((hw >> (shift + BITS)) & MASK) << 16)  # [BN, W, P]
    if GPT > 0:
        s = _per_word(s_t, BLOCK_N, GPT, W)  # [BN, W or 1]
        z = _per_word(z_t, BLOCK_N, GPT, W)
        if OFFSET:
            pairs = pairs + (((MAGIC + OFF) - z.to(tl.int32)) * 0x10001)[:, :, None]  # BIAS + OFF + q - z
        elif MAGIC != 0:
            pairs = pairs | (MAGIC * 0x10001)  # BIAS + q, exactly
        if NATIVE:
            s, z = s.to(dtype), (BIAS + z).to(dtype)
        s, z = s[:, :, None, None], z[:, :, None, None]
    elif MAGIC != 0:
        pairs = pairs | (MAGIC * 0x10001)
    halves = tl.join(pairs.to(tl.int16), (pairs >> 16).to(tl.int16))  # [BN, W, P, 2]: k = PACK w + 2 p + j
    if MAGIC != 0:
        w = halves.to(dtype, bitcast=True)
    else:  # q through the fp32 magic 2**23 (exact), then one conversion
        w = _exact_float(halves.to(tl.int32) & 0xFFFF, dtype)
    if GPT == 0:  # groups not aligned to tiles: the group of each value
        w = tl.reshape(w, [BLOCK_N, BLOCK_K])
        s, z = _gathered_params(scale_ptr, zero_ptr, offs_n, mask_n, k0 + offs_k, K, scale_row_stride,
                                zero_row_stride, dtype, BITS, GROUP, HAS_ZERO, BIAS, NATIVE)  # fmt: skip
    return tl.reshape(_dequant(w, s, z, dtype, BITS, BIAS, OFFSET, NATIVE), [BLOCK_N, BLOCK_K])


@triton.jit
def _prefill_kernel(
    x_ptr,  # [M, K] activations (fp16/bf16)
    qw_ptr,  # [N, ceil(K / PACK)] packed int32 weight
    scale_ptr,  # [N, ceil(K / GROUP)]
    zero_ptr,  # [ceil(N / PACK), ceil(K / GROUP)] int32 packed zero points (only when HAS_ZERO)
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
    NATIVE: tl.constexpr,  # dequantize in the activation dtype (the scales are in it): see the module doc
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,  # how partial tiles meet: see _write_tile
    EVEN_K: tl.constexpr,
    GPT: tl.constexpr,  # groups per K tile when groups align to tiles (1 for groups of whole tiles), else 0
    SWIZZLE: tl.constexpr,  # N tiles per band of the launch order (tiles sharing x run together)
    DOT_FP32: tl.constexpr,  # upcast the dot operands (Triton's interpreter gets bf16 tl.dot wrong)
    ASYNC_MMA: tl.constexpr,  # compiled for Hopper, whose dots (wgmma) are asynchronous: see _after_mma
    TRACED: tl.constexpr,  # launched by torch.compile's code: see _after_mma
):
    """Prefill: a tensor-core GEMM that dequantizes the weight tile in registers (no dense weight in memory).

    Each program computes ``acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile.T`` with the weight as the wgmma's A
    operand, from registers, and one dot a K tile. :func:`_tile_weight` makes that operand from the int32
    words in the layout the tensor cores read, so the words go from their pipelined shared-memory stage to
    the tensor cores without another trip through shared memory, and the activations stream in as in any
    GEMM (16-byte copies). Each tile's products are in flight together; :func:`_after_mma` waits for them
    before the next tile's weights are written. Each weight is ``(q - z) * s`` rounded once, as
    :func:`_dequantize_kernel` writes it, so the product matches dequantize + cuBLAS up to accumulation order.
    (The kernel this replaced unpacked [N, W, 8] -> [N, K] through shared memory and ran its K-16 products one
    at a time: 0.37-0.45x bf16 cuBLAS from 512 rows against 0.62-0.79x now; NOTES.md.)
    """
    PACK: tl.constexpr = 32 // BITS  # values per int32 word
    W: tl.constexpr = BLOCK_K // PACK  # words per row of a tile
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_m = tl.cdiv(M, BLOCK_M)
    band = pid // (SWIZZLE * tiles_m)  # bands of SWIZZLE N tiles, each walked column by column
    first_n = band * SWIZZLE
    band_n = tl.minimum(tiles_n - first_n, SWIZZLE)
    pid_n = first_n + (pid % (SWIZZLE * tiles_m)) % band_n
    pid_m = (pid % (SWIZZLE * tiles_m)) // band_n
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_w = tl.arange(0, W)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    n_words = tl.cdiv(K, PACK)
    qw_rows = qw_ptr + offs_n[:, None].to(tl.int64) * qw_row_stride
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * x_row_stride
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    tile_begin = pid_k * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for tile in range(tile_begin, tile_end):
        k0 = tile * BLOCK_K
        words = k0 // PACK + offs_w
        h, xt = _load_tile(qw_rows, x_rows, words, k0 + offs_k, mask_n, mask_m, n_words, K, EVEN_K)
        if ASYNC_MMA:
            h = _after_mma(h, TRACED)
        if GPT > 0:
            s_t, z_t = _tile_params(scale_ptr, zero_ptr, offs_n, mask_n, tile, K, scale_row_stride,
                                    zero_row_stride, BITS, GROUP, HAS_ZERO, BLOCK_K, GPT)  # fmt: skip
        else:
            s_t, z_t = 0, 0  # gathered per value (_tile_weight)
        w = _tile_weight(h, s_t, z_t, k0, offs_k, offs_n, mask_n, K, scale_ptr, zero_ptr, scale_row_stride,
                         zero_row_stride, dtype, BITS, GROUP, HAS_ZERO, MAGIC, BIAS, NATIVE, GPT, BLOCK_N,
                         BLOCK_K)  # fmt: skip
        acc = _mma(w, tl.trans(xt), acc, DOT_FP32)
    _write_tile(acc, y_ptr, ws_ptr, count_ptr, offs_n, offs_m, mask_n, mask_m, y_row_stride, n_splits, MODE)


@triton.jit
def _from_owned(v, R: tl.constexpr, BLOCK_K: tl.constexpr):
    """v [R, BLOCK_K] unpacked from owned words (position 8 w + j: value j of word w) in K order. With
    w = 4 b + p and j = 4 h + q, position (b, p, h, q) holds K 32 b + 8 q + 2 p + h (to_owned_order)."""
    v = tl.reshape(v, [R, BLOCK_K // 32, 4, 2, 4])
    return tl.reshape(tl.permute(v, [0, 1, 4, 2, 3]), [R, BLOCK_K])


@triton.jit
def _to_owned(v, R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Inverse of :func:`_from_owned`: v [R, BLOCK_K] in K order (b, q, p, h) at the positions (b, p, h, q)
    of the values unpacked from owned words."""
    v = tl.reshape(v, [R, BLOCK_K // 32, 4, 4, 2])
    return tl.reshape(tl.permute(v, [0, 1, 3, 4, 2]), [R, BLOCK_K])


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
    GPT: tl.constexpr,  # groups per K tile when groups align to tiles (1 for groups of whole tiles), else 0
    OWNED: tl.constexpr = False,  # owned weights: words as quant_layout.to_owned_order, zero points as
    # to_owned_zeros (groups of 32 or more)
):
    """W[n, k] = ((q - z) * s) in fp32, rounded once to the output dtype (compressed-tensors' formula).

    Each packed word is loaded once and split into its values in registers, and the scales of a tile are
    one [BLOCK_N, GPT] load when groups align to it (per-value gathers only for straddling groups). Owned
    words hold each value in the same group as the packed words do (groups of 32 or more), so only the
    order of the values differs (:func:`_from_owned`)."""
    PACK: tl.constexpr = 32 // BITS
    W: tl.constexpr = BLOCK_K // PACK
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tile = tl.program_id(1)
    words = tile * W + tl.arange(0, W)
    offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    rows = offs_n[:, None].to(tl.int64)
    h = tl.load(qw_ptr + rows * qw_row_stride + words[None, :],
                mask=mask_n[:, None] & (words < tl.cdiv(K, PACK))[None, :], other=0)  # fmt: skip
    q = _unpack(h, BLOCK_N, BLOCK_K, BITS)
    mask = mask_n[:, None] & (offs_k < K)[None, :]
    s, z = _value_params(scale_ptr, zero_ptr, offs_n, mask_n, tile, offs_k, K, scale_row_stride,
                         zero_row_stride, BITS, GROUP, HAS_ZERO, BLOCK_N, BLOCK_K, GPT, OWNED)  # fmt: skip
    w = (q.to(tl.float32) - z) * s
    if OWNED:  # into K order in registers: the stores stay contiguous (scattered, they took ~10x as long)
        w = _from_owned(w, BLOCK_N, BLOCK_K)
    tl.store(w_ptr + rows * w_row_stride + offs_k[None, :], w.to(w_ptr.dtype.element_ty), mask=mask)
