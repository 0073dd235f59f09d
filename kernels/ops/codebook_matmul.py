"""Weight-sharing matmul, ``squeezeserve::codebook_matmul``: ``y = x @ W.T`` with every weight looked up in
its row's codebook inside the kernel (``kernels/codebook_layout.py`` defines the layout).

Three kernels; in each a program owns BLOCK_N output rows and a run of K tiles (split-K when the N tiles
alone would leave SMs idle), and the dequantized weight never exists in global memory. 4-bit codebooks
never touch memory per weight either: a row's 16 values live in eight registers as byte tables, and PTX
``prmt`` picks the bytes of eight values per index word (``_lookup8``, about 3.5 instructions a value).
One row (decode) takes the FMA kernel at 4 bits (``_codebook_fma_kernel``: looked-up values times the
activations on the FMA units) and the word-wise LUT kernel at 3 bits (``_codebook_lut_kernel``: weights
loaded from the codebook in L1). More rows take the tensor-core kernel: per K tile its [BLOCK_N, BLOCK_K]
weight values (4 bits: the byte tables; 3 bits: the indices unpacked with shifts and ``tl.gather`` from
the rows' codebooks in registers) are the A operand of ``tl.dot``
(``acc[BLOCK_N, BLOCK_M] = W_tile @ x_tile.T``), as ``quant_matmul``'s skinny kernel.
4-bit tiles load whole index words (8 indices each) and split them in registers; 3-bit words (10 indices)
straddle power-of-two tiles, so each index loads its word (neighbours share the address). Split-K partials
meet in ``quant_matmul``'s self-cleaning workspace (``_write_tile``), in the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from squeezeserve.kernels import codebook_layout, reference
from squeezeserve.kernels.ops import launch as _launch
from squeezeserve.kernels.ops.launch import cdiv, no_workspace, sm_count, traceable
from squeezeserve.kernels.ops.quant_matmul import _workspace, workspace_buffers
from squeezeserve.kernels.ops.quant_matmul_kernels import _load_tile, _unpack, _write_tile
from squeezeserve.kernels.ops.replay import LaunchPlans
from squeezeserve.kernels.registry import EagerOp, eager, interpreting, use_reference


def _lookup_ptx(fp32: bool, fp16: bool) -> str:
    """PTX that turns one word of eight 4-bit indices into their eight codebook values (operands: $0-$7 the
    values, $8 the word, $9-$12 the low bytes of the row's 16 values four to a register, $13-$16 the high
    bytes), with no memory access: ``prmt`` picks four bytes of eight by four 3-bit selectors at once, so
    each byte of four values takes a ``prmt`` from entries 0-7, one from 8-15 and a ``lop3`` choosing by
    the index's top bit (a per-byte mask that one more ``prmt`` makes, replicating sign bits). Two ``prmt``
    interleave the low and high bytes into 16-bit values; ``fp32`` widens them (bf16: a shift or a mask;
    fp16: a convert), else they come out as 16-bit registers. About 3.5 instructions a value."""
    lines = ["and.b32 s, $8, 0x77777777;", "shl.b32 t, $8, 4;"]
    for half, mask_selector in ((0, "0xD9C8"), (1, "0xFBEA")):
        if half:
            lines.append("shr.b32 s, s, 16;")
        lines += [
            f"prmt.b32 m, t, $8, {mask_selector};",  # 0xFF in byte i where value i's index has bit 3 set
            "prmt.b32 a, $9, $10, s;", "prmt.b32 b, $11, $12, s;", "lop3.b32 lo, a, b, m, 0xD8;",
            "prmt.b32 a, $13, $14, s;", "prmt.b32 b, $15, $16, s;", "lop3.b32 hi, a, b, m, 0xD8;",
            "prmt.b32 p, lo, hi, 0x5140;", "prmt.b32 q, lo, hi, 0x7362;",
        ]  # fmt: skip
        for pair, reg in enumerate(("p", "q")):
            o = 4 * half + 2 * pair
            if not fp32:
                lines.append(f"mov.b32 {{${o}, ${o + 1}}}, {reg};")
            elif fp16:
                lines += [f"mov.b32 {{h0, h1}}, {reg};", f"cvt.f32.f16 ${o}, h0;"]
                lines.append(f"cvt.f32.f16 ${o + 1}, h1;")
            else:
                lines += [f"shl.b32 ${o}, {reg}, 16;", f"and.b32 ${o + 1}, {reg}, 0xFFFF0000;"]
    # (one line: Inductor copies a traced kernel's source, and line breaks broke the string there)
    return "{ .reg .b32 s, t, m, a, b, lo, hi, p, q; .reg .b16 h0, h1; " + " ".join(lines) + " }"


_PTX_BF16_F32 = tl.constexpr(_lookup_ptx(True, False))
_PTX_FP16_F32 = tl.constexpr(_lookup_ptx(True, True))
_PTX_16 = tl.constexpr(_lookup_ptx(False, False))


@triton.jit
def _byte_pair(cb_rows, col, mask_n, dtype: tl.constexpr):
    """Four codebook values (columns col..col+3 of each row, rounded to ``dtype``): their low bytes and high
    bytes, each packed into one int32 [BLOCK_N, 1] (value j in byte j)."""
    offs = tl.arange(0, 4)
    v = tl.load(cb_rows + col + offs[None, :], mask=mask_n[:, None], other=0.0)
    v = v.to(dtype).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    shifts = (offs * 8)[None, :]
    return tl.sum((v & 0xFF) << shifts, axis=1)[:, None], tl.sum((v >> 8) << shifts, axis=1)[:, None]


@triton.jit
def _byte_tables(cb_rows, col, mask_n, dtype: tl.constexpr):
    """The 16 values of each row's codebook at ``col`` as byte tables for :func:`_lookup8`: low bytes of
    values 0-3, 4-7, 8-11, 12-15, then the high bytes, each [BLOCK_N, 1] int32."""
    l0, h0 = _byte_pair(cb_rows, col, mask_n, dtype)
    l1, h1 = _byte_pair(cb_rows, col + 4, mask_n, dtype)
    l2, h2 = _byte_pair(cb_rows, col + 8, mask_n, dtype)
    l3, h3 = _byte_pair(cb_rows, col + 12, mask_n, dtype)
    return l0, l1, l2, l3, h0, h1, h2, h3


@triton.jit
def _table_byte(t0, t1, t2, t3, index):
    """Byte ``index`` (0-15) of the table t0..t3 (uint32, four bytes each): the interpreter's ``prmt``."""
    q = index >> 2
    reg = tl.where(q == 0, t0, tl.where(q == 1, t1, tl.where(q == 2, t2, t3)))
    return (reg >> ((index & 3) * 8)) & 0xFF


@triton.jit
def _emulated_value(h, j: tl.constexpr, l0, l1, l2, l3, h0, h1, h2, h3, dtype: tl.constexpr,
                    FP32: tl.constexpr):  # fmt: skip
    index = (h >> (4 * j)) & 15
    bits = _table_byte(l0, l1, l2, l3, index) | (_table_byte(h0, h1, h2, h3, index) << 8)
    value = bits.to(tl.uint16).to(dtype, bitcast=True)
    return value.to(tl.float32) if FP32 else value


@triton.jit
def _lookup8(h, l0, l1, l2, l3, h0, h1, h2, h3, dtype: tl.constexpr, FP32: tl.constexpr, ASM: tl.constexpr):
    """The codebook values of the eight 4-bit indices of words h (int32, any shape; tables from
    :func:`_byte_tables` broadcast to it), value j from bits 4j..4j+3: fp32 if ``FP32``, else ``dtype``.
    ``ASM``: the ``prmt`` PTX (:func:`_lookup_ptx`); else the same byte tables read with shifts (Triton's
    interpreter runs no PTX)."""
    if ASM:
        args = [h, l0, l1, l2, l3, h0, h1, h2, h3]
        if not FP32:  # the bits as they are, in x's dtype
            v = tl.inline_asm_elementwise(_PTX_16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r,r,r,r", args,
                                          dtype=(tl.int16,) * 8, is_pure=True, pack=1)  # fmt: skip
            return (v[0].to(dtype, bitcast=True), v[1].to(dtype, bitcast=True), v[2].to(dtype, bitcast=True),
                    v[3].to(dtype, bitcast=True), v[4].to(dtype, bitcast=True), v[5].to(dtype, bitcast=True),
                    v[6].to(dtype, bitcast=True), v[7].to(dtype, bitcast=True))  # fmt: skip
        elif dtype == tl.float16:
            return tl.inline_asm_elementwise(_PTX_FP16_F32, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", args,
                                             dtype=(tl.float32,) * 8, is_pure=True, pack=1)  # fmt: skip
        else:
            return tl.inline_asm_elementwise(_PTX_BF16_F32, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", args,
                                             dtype=(tl.float32,) * 8, is_pure=True, pack=1)  # fmt: skip
    else:
        h = h.to(tl.uint32, bitcast=True)
        l0, l1, l2, l3 = (l0.to(tl.uint32, bitcast=True), l1.to(tl.uint32, bitcast=True),
                          l2.to(tl.uint32, bitcast=True), l3.to(tl.uint32, bitcast=True))  # fmt: skip
        h0, h1, h2, h3 = (h0.to(tl.uint32, bitcast=True), h1.to(tl.uint32, bitcast=True),
                          h2.to(tl.uint32, bitcast=True), h3.to(tl.uint32, bitcast=True))  # fmt: skip
        return (
            _emulated_value(h, 0, l0, l1, l2, l3, h0, h1, h2, h3, dtype, FP32),
            _emulated_value(h, 1, l0, l1, l2, l3, h0, h1, h2, h3, dtype, FP32),
            _emulated_value(h, 2, l0, l1, l2, l3, h0, h1, h2, h3, dtype, FP32),
            _emulated_value(h, 3, l0, l1, l2, l3, h0, h1, h2, h3, dtype, FP32),
            _emulated_value(h, 4, l0, l1, l2, l3, h0, h1, h2, h3, dtype, FP32),
            _emulated_value(h, 5, l0, l1, l2, l3, h0, h1, h2, h3, dtype, FP32),
            _emulated_value(h, 6, l0, l1, l2, l3, h0, h1, h2, h3, dtype, FP32),
            _emulated_value(h, 7, l0, l1, l2, l3, h0, h1, h2, h3, dtype, FP32),
        )


@triton.jit
def _stack8(x0, x1, x2, x3, x4, x5, x6, x7, R: tl.constexpr, W: tl.constexpr):
    """Pieces [R, W] -> [R, W, 8] with piece j at [:, :, j] (in each thread's registers: joins only)."""
    even = tl.join(tl.join(x0, x4), tl.join(x2, x6))  # [R, W, c, a]: piece 4 c + 2 a
    odd = tl.join(tl.join(x1, x5), tl.join(x3, x7))
    return tl.reshape(tl.join(even, odd), [R, W, 8])


@triton.jit
def _codebook_fma_kernel(
    x_ptr,  # [1, K] activations (fp16/bf16)
    idx_ptr,  # [N, ceil(K / 8)] int32 packed 4-bit codebook indices
    cb_ptr,  # [N, groups * 16] codebook values (fp16)
    y_ptr,  # [1, N]: the output dtype, or fp32 partial sums (MODE 1)
    ws_ptr,  # fp32 split-K workspace, zero between calls (MODE 2)
    count_ptr,  # int32 arrivals per output tile, zero between calls (MODE 2)
    N,
    K,
    idx_row_stride,
    cb_row_stride,
    tiles_per_split,
    GROUP: tl.constexpr,  # input columns per codebook, a multiple of BLOCK_K; 0: one codebook per row
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,  # how split-K partial tiles meet: quant_matmul's _write_tile
    EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,  # software-pipeline depth of the index loads
    ASM: tl.constexpr,  # the prmt lookup (compiled); else its emulation (the interpreter)
):
    """One activation row (decode) of 4-bit codebooks on the FMA units: a program's rows keep their
    codebooks as byte tables in registers (8 registers a row, built once per codebook), every index word
    becomes its 8 values with :func:`_lookup8` (``prmt``: no memory access, no shuffle) and each value is
    multiplied by its activation in fp32. The values stack to [BLOCK_N, W, 8] in each thread's registers,
    the activations load as [W, 8] (a word's 8 in one vector), and the products sum per (output, word,
    slot), reduced once after the K loop."""
    W: tl.constexpr = BLOCK_K // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, W)
    mask_n = offs_n < N
    n_words = tl.cdiv(K, 8)
    idx_rows = idx_ptr + offs_n[:, None].to(tl.int64) * idx_row_stride
    cb_rows = cb_ptr + offs_n[:, None].to(tl.int64) * cb_row_stride
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    if GROUP == 0:
        l0, l1, l2, l3, h0, h1, h2, h3 = _byte_tables(cb_rows, 0, mask_n, dtype)
    offs_j = tl.arange(0, 8)
    acc = tl.zeros([BLOCK_N, W, 8], dtype=tl.float32)
    tile_begin = pid_k * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for tile in tl.range(tile_begin, tile_end, num_stages=STAGES):
        k0 = tile * BLOCK_K
        if GROUP > 0:  # a K tile lies inside one group
            l0, l1, l2, l3, h0, h1, h2, h3 = _byte_tables(cb_rows, (k0 // GROUP) * 16, mask_n, dtype)
        words = k0 // 8 + offs_w
        if EVEN_K:
            h = tl.load(idx_rows + words[None, :], mask=mask_n[:, None], other=0)
        else:
            h = tl.load(idx_rows + words[None, :], mask=mask_n[:, None] & (words < n_words)[None, :], other=0)
        w0, w1, w2, w3, w4, w5, w6, w7 = _lookup8(h, l0, l1, l2, l3, h0, h1, h2, h3, dtype, True, ASM)
        w = _stack8(w0, w1, w2, w3, w4, w5, w6, w7, BLOCK_N, W)  # [BLOCK_N, W, 8]: column k0 + 8 t + j
        ks = k0 + offs_w[:, None] * 8 + offs_j[None, :]  # [W, 8]: a word's 8 activations, one vector load
        x = tl.load(x_ptr + ks) if EVEN_K else tl.load(x_ptr + ks, mask=ks < K, other=0.0)
        acc += w * x.to(tl.float32)[None, :, :]
    offs_m = tl.arange(0, 1)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)[:, None]
    _write_tile(y, y_ptr, ws_ptr, count_ptr, offs_n, offs_m, mask_n, offs_m < 1, N, tl.num_programs(2), MODE)


@triton.jit
def _codebook_matmul_kernel(
    x_ptr,  # [M, K] activations (fp16/bf16)
    idx_ptr,  # [N, ceil(K / (32 // BITS))] int32 packed codebook indices
    cb_ptr,  # [N, groups * 2**BITS] codebook values (fp16)
    y_ptr,  # [M, N]: the output dtype, or fp32 partial sums (MODE 1)
    ws_ptr,  # fp32 split-K workspace, zero between calls (MODE 2)
    count_ptr,  # int32 arrivals per output tile, zero between calls (MODE 2)
    M,
    N,
    K,
    x_row_stride,
    idx_row_stride,
    cb_row_stride,
    y_row_stride,
    tiles_per_split,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,  # input columns per codebook, a multiple of BLOCK_K; 0: one codebook per row
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MODE: tl.constexpr,  # how split-K partial tiles meet: quant_matmul's _write_tile
    DOT_FP32: tl.constexpr,  # upcast the dot operands (Triton's interpreter gets bf16 tl.dot wrong)
    TABLES: tl.constexpr,  # 4 bits: values from byte tables (_lookup8), not tl.gather
    ASM: tl.constexpr,  # with TABLES: the prmt lookup (compiled); else its emulation (the interpreter)
    EVEN_K: tl.constexpr,  # 4 bits, K a multiple of BLOCK_K: no K masks
):
    """y[m, n] = sum_k x[m, k] C[n, g(k) E + i[n, k]],  i[n, k] = (words[n, k // P] >> BITS (k % P)) & (E-1),
    P = 32 // BITS, E = 2**BITS, g(k) = k // GROUP (0 per channel)."""
    PER_WORD: tl.constexpr = 32 // BITS
    E: tl.constexpr = 1 << BITS
    W: tl.constexpr = BLOCK_K // PER_WORD  # whole index words a K tile holds (4 bits)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_e = tl.arange(0, E)
    mask_n = offs_n < N
    mask_m = offs_m < M
    idx_rows = idx_ptr + offs_n[:, None].to(tl.int64) * idx_row_stride
    cb_rows = cb_ptr + offs_n[:, None].to(tl.int64) * cb_row_stride
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * x_row_stride
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    if GROUP == 0:  # the rows' codebooks stay in registers for the whole K range
        if TABLES:
            l0, l1, l2, l3, h0, h1, h2, h3 = _byte_tables(cb_rows, 0, mask_n, dtype)
        else:
            codebook = tl.load(cb_rows + offs_e[None, :], mask=mask_n[:, None], other=0.0)
    n_words = tl.cdiv(K, PER_WORD)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    tile_begin = pid_k * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for tile in range(tile_begin, tile_end):
        ks = tile * BLOCK_K + offs_k
        mask_k = ks < K
        if GROUP > 0:  # a K tile lies inside one group
            group = (tile * BLOCK_K) // GROUP
            if TABLES:
                l0, l1, l2, l3, h0, h1, h2, h3 = _byte_tables(cb_rows, group * E, mask_n, dtype)
            else:
                codebook = tl.load(cb_rows + group * E + offs_e[None, :], mask=mask_n[:, None], other=0.0)
        if PER_WORD * BITS == 32:  # 4 bits: a tile is whole words, loaded once and split in registers
            offs_w = tile * W + tl.arange(0, W)
            words, x = _load_tile(idx_rows, x_rows, offs_w, ks, mask_n, mask_m, n_words, K, EVEN_K)
            if TABLES:  # each word's 8 values by prmt, in registers
                v0, v1, v2, v3, v4, v5, v6, v7 = _lookup8(words, l0, l1, l2, l3, h0, h1, h2, h3, dtype, False,
                                                          ASM)  # fmt: skip
                w = tl.reshape(_stack8(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N, W), [BLOCK_N, BLOCK_K])
            else:
                w = tl.gather(codebook, _unpack(words, BLOCK_N, BLOCK_K, BITS), axis=1).to(dtype)
        else:  # 3 bits, 10 a word: words straddle tiles; P neighbours share a load address (one transaction)
            words = tl.load(
                idx_rows + (ks // PER_WORD)[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0
            )
            index = (words >> ((ks % PER_WORD) * BITS)[None, :]) & (E - 1)
            w = tl.gather(codebook, index, axis=1).to(dtype)  # [BLOCK_N, BLOCK_K], rounded like the reference
            x = tl.load(x_rows + ks[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if DOT_FP32:
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)))
        else:
            acc += tl.dot(w, tl.trans(x))
    n_splits = tl.num_programs(2)
    _write_tile(acc, y_ptr, ws_ptr, count_ptr, offs_n, offs_m, mask_n, mask_m, y_row_stride, n_splits, MODE)


@triton.jit
def _codebook_lut_kernel(
    x_ptr,  # [1, K] activations (fp16/bf16)
    idx_ptr,  # [N, ceil(K / (32 // BITS))] int32 packed codebook indices
    cb_ptr,  # [N, groups * 2**BITS] codebook values (fp16, or x's dtype)
    y_ptr,  # [1, N]: the output dtype, or fp32 partial sums (MODE 1)
    ws_ptr,  # fp32 split-K workspace, zero between calls (MODE 2)
    count_ptr,  # int32 arrivals per output tile, zero between calls (MODE 2)
    N,
    K,
    idx_row_stride,
    cb_row_stride,
    tiles_per_split,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,  # input columns per codebook; 0: one codebook per row
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,  # index words per K tile (BLOCK_W * 32 // BITS input columns)
    MODE: tl.constexpr,  # how split-K partial tiles meet: quant_matmul's _write_tile
):
    """One activation row (decode), computed word-wise: a K tile is BLOCK_W whole index words per row, and
    for each of a word's P slots j the kernel takes index (word >> BITS j) & (E-1) for every word of the
    tile at once, loads the weight from the row's codebook in memory (E values, 32 bytes at 4 bits: the
    tile's codebooks stay in L1 after the first touch, so a load per weight and no shuffles) and multiplies
    it by the activation of column w P + j. Every tensor keeps the words' [BLOCK_N, BLOCK_W] layout: no
    reshape, no layout conversion per value; products sum in a [BLOCK_N, BLOCK_W] accumulator reduced once
    at the end. Against the gather kernel's one-row path, 2.2-3.0x faster on the H100 (0.30-0.45x our
    int4 g128 kernel). About 9 instructions a weight (sm_90 SASS) and 0.44 TB/s from DRAM: neither bounds
    it, which leaves the one 2-byte L1 load per weight (inferred, not profiled)."""
    P: tl.constexpr = 32 // BITS
    E: tl.constexpr = 1 << BITS
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    # Rows past N read row N-1 (their sums are never stored), so the per-weight codebook loads need no mask.
    rows = tl.minimum(offs_n, N - 1)[:, None]
    idx_rows = idx_ptr + rows.to(tl.int64) * idx_row_stride
    cb_offs = rows * cb_row_stride  # int32 offsets from one base: one add per weight address
    dtype = x_ptr.dtype.element_ty
    n_words = tl.cdiv(K, P)
    acc_w = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    tile_begin = pid_k * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tl.cdiv(n_words, BLOCK_W))
    for tile in range(tile_begin, tile_end):
        offs_w = tile * BLOCK_W + tl.arange(0, BLOCK_W)
        # unsigned: a logical shift, no sign extension per index
        words = tl.load(idx_rows + offs_w[None, :], mask=(offs_w < n_words)[None, :], other=0).to(
            tl.uint32, bitcast=True
        )
        for j in tl.static_range(P):
            ks = offs_w * P + j
            mask_k = ks < K
            index = ((words >> (j * BITS)) & (E - 1)).to(tl.int32)
            if GROUP > 0:  # columns past K (zero activations) read the last group
                index += (tl.minimum(ks, K - 1) // GROUP)[None, :] * E
            w = tl.load(cb_ptr + (cb_offs + index)).to(dtype)  # rounded like the reference
            x = tl.load(x_ptr + ks, mask=mask_k, other=0.0)
            acc_w += w.to(tl.float32) * x.to(tl.float32)[None, :]
    acc = tl.sum(acc_w, axis=1)[:, None]
    offs_m = tl.arange(0, 1)
    _write_tile(
        acc, y_ptr, ws_ptr, count_ptr, offs_n, offs_m, mask_n, offs_m < 1, N, tl.num_programs(2), MODE
    )


def check_inputs(
    x: torch.Tensor, indices: torch.Tensor, codebook: torch.Tensor, group_size: int, bits: int
) -> None:
    if bits not in codebook_layout.BITS:
        raise ValueError(f"codebook_matmul: bits must be one of {codebook_layout.BITS}, got {bits}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"codebook_matmul: x must be fp16, bf16 or fp32, got {x.dtype}")
    k_in, per_word = x.shape[-1], 32 // bits
    if indices.dtype != torch.int32 or indices.dim() != 2 or indices.shape[1] != -(-k_in // per_word):
        raise ValueError(
            f"codebook_matmul: indices must be int32 [N, {-(-k_in // per_word)}] for K={k_in} at {bits} "
            f"bits, got {indices.dtype} {tuple(indices.shape)}"
        )
    if group_size < 0 or (group_size and (group_size % 16 or k_in % group_size)):
        raise ValueError(
            f"codebook_matmul: group_size must be 0 (per channel) or a multiple of 16 dividing K={k_in}, "
            f"got {group_size}"
        )
    groups = k_in // group_size if group_size else 1
    if tuple(codebook.shape) != (indices.shape[0], groups << bits):
        raise ValueError(
            f"codebook_matmul: codebook must be [{indices.shape[0]}, {groups << bits}], got "
            f"{tuple(codebook.shape)}"
        )


def launch_config(m: int, n_out: int, k_in: int, group_size: int, sms: int | None, bits: int = 4) -> dict:
    """Kernel, tile sizes and split-K for ``m`` rows on a GPU with ``sms`` SMs (None: Triton's interpreter,
    small tiles). A pure function, so tests run the GPU's choice on any backend. The 4-bit settings are the
    best of ``tests/gpu/codebook_prmt_sweep.py`` on the H100 (2026-11-24, tests/benchmarks/NOTES.md) at every
    decode point, 0.93-1.10x our int4 g128 ``quant_matmul`` at one row and 0.95-1.06x at 2-16:

    - 4 bits, one row: the FMA kernel (``kernel: fma``), 8 output rows and 512 columns a program (two
      warps), K split only where the N tiles fill the SMs less than twice (a split cost 4-18% at N >= 4096);
      a K tile must lie inside one codebook group, so grouped codebooks halve it until it does.
    - 3 bits, one row: the word-wise LUT kernel (``kernel: lut``), 4 output rows and 64 index words a
      program, split over K only where the N tiles leave SMs idle (``codebook_lut_sweep.py``, 2026-11-23).
    - Several rows: the tensor-core kernel, 64-wide N tiles at up to 16 rows; at 4 bits K is split in the
      smallest power of two that gives 3.5 programs an SM (8 ways at N = 4096, 4 at 14336: 5-23% faster than
      the neighbouring powers), at 3 bits until the grid fills the GPU twice over."""
    if m == 1 and bits == 4:
        block_n, block_k = (16, 32) if sms is None else (8, 512)
        while group_size and group_size % block_k:
            block_k //= 2  # group_size is a multiple of 16
        tiles = cdiv(k_in, block_k)
        split = min(2, tiles) if sms is None else max(1, min(tiles, cdiv(2 * sms, cdiv(n_out, block_n))))
        return {"kernel": "fma", "BLOCK_M": 1, "BLOCK_N": block_n, "BLOCK_K": block_k, "split": split,
                "num_warps": 4 if sms is None else 2, "num_stages": 1 if sms is None else 3}  # fmt: skip
    if m == 1:
        block_n, block_w = (16, 8) if sms is None else (4, 64)
        tiles = cdiv(cdiv(k_in, 32 // bits), block_w)
        if sms is None:  # split-K whenever there are two tiles, so the tests cover both paths
            split = min(2, tiles)
        else:
            split = max(1, min(tiles, cdiv(2 * sms, cdiv(n_out, block_n))))
        return {"kernel": "lut", "BLOCK_M": 1, "BLOCK_N": block_n, "BLOCK_W": block_w, "split": split}
    block_k = 32 if sms is None else 128
    while group_size and group_size % block_k:
        block_k //= 2  # group_size is a multiple of 16
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 16 if sms is None else (64 if m <= 16 else 128)
    tiles = cdiv(k_in, block_k)
    if sms is None:  # split-K whenever there are two tiles, so the tests cover both paths
        return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "split": min(2, tiles)}
    programs = cdiv(n_out, block_n) * cdiv(m, block_m)
    if bits == 4 and m <= 16:
        split = 1
        while split < 16 and programs * split * 2 < 7 * sms:
            split *= 2
    else:
        split = cdiv(2 * sms, programs)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "split": max(1, min(tiles, split))}


def _codebook_matmul(
    x: torch.Tensor, indices: torch.Tensor, codebook: torch.Tensor, group_size: int, bits: int
) -> torch.Tensor:
    check_inputs(x, indices, codebook, group_size, bits)
    if use_reference(x) or x.dtype == torch.float32:
        return reference.codebook_matmul(x, indices, codebook, group_size, bits)
    n_out, k_in = indices.shape[0], x.shape[-1]
    x2 = x.reshape(-1, k_in)
    sms = None if interpreting() else sm_count(x.device)
    cfg = launch_config(x2.shape[0], n_out, k_in, group_size, sms, bits)
    return launch(x2, indices, codebook, group_size, bits, cfg).reshape(*x.shape[:-1], n_out)


def launch(
    x2: torch.Tensor, indices: torch.Tensor, codebook: torch.Tensor, group_size: int, bits: int, cfg: dict
) -> torch.Tensor:
    """y [M, N] = x2 [M, K] @ W.T with the kernel, tiles and split-K of ``cfg`` (:func:`launch_config`'s keys:
    ``kernel: lut`` with BLOCK_W index words a tile for one row, ``kernel: fma`` (4 bits, one row, K tiles
    inside one group) or the tensor-core kernel with BLOCK_K, its 4-bit values from the byte tables unless
    ``tables: False`` (``tl.gather``); a
    probe may add ``num_warps``, ``num_stages``, or ``mode`` to pick how split-K partials meet,
    ``_write_tile``'s MODE)."""
    n_out, k_in = indices.shape[0], x2.shape[-1]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    indices, codebook = indices.contiguous(), codebook.contiguous()
    kind = cfg.get("kernel", "mma")
    if kind == "fma" and (bits != 4 or group_size % cfg["BLOCK_K"]):
        raise ValueError(f"codebook_matmul: the FMA kernel takes 4 bits in groups of whole K tiles, got "
                         f"{bits} bits, group {group_size}, BLOCK_K {cfg['BLOCK_K']}")  # fmt: skip
    lut = kind == "lut"
    tiles = cdiv(cdiv(k_in, 32 // bits), cfg["BLOCK_W"]) if lut else cdiv(k_in, cfg["BLOCK_K"])
    tiles_per_split = cdiv(tiles, cfg["split"])
    split = cdiv(tiles, tiles_per_split)
    grid = (cdiv(n_out, cfg["BLOCK_N"]), cdiv(m, cfg["BLOCK_M"]), split)
    # Split-K partials meet as quant_matmul's do: in its self-cleaning workspace (one launch, no memset or
    # cast kernel, which at decode sizes would cost as much as the matmul) unless torch may be tracing.
    mode = 0 if split == 1 else cfg.get("mode", 2 if eager(x2, indices, codebook) else 1)
    y_dtype = torch.float32 if mode == 1 else x2.dtype
    y = (torch.zeros if mode == 1 else torch.empty)((m, n_out), dtype=y_dtype, device=x2.device)
    ws, counts = _workspace(x2.device, m * n_out, grid[0] * grid[1]) if mode == 2 and m else no_workspace(y)
    if m > 1 and kind in ("lut", "fma"):
        raise ValueError(f"codebook_matmul: the {kind.upper()} kernel takes one row, got {m}")
    if m and lut:
        traceable(_codebook_lut_kernel)[grid](
            x2, indices, codebook, y, ws, counts, n_out, k_in, indices.stride(0), codebook.stride(0),
            tiles_per_split, BITS=bits, GROUP=group_size, BLOCK_N=cfg["BLOCK_N"], BLOCK_W=cfg["BLOCK_W"],
            MODE=mode, num_warps=cfg.get("num_warps", 4),
            **({"num_stages": cfg["num_stages"]} if "num_stages" in cfg else {}),
        )  # fmt: skip
    elif m and kind == "fma":
        traceable(_codebook_fma_kernel)[grid](
            x2, indices, codebook, y, ws, counts, n_out, k_in, indices.stride(0), codebook.stride(0),
            tiles_per_split, GROUP=group_size, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], MODE=mode,
            EVEN_K=k_in % cfg["BLOCK_K"] == 0, STAGES=cfg.get("num_stages", 1), ASM=not interpreting(),
            num_warps=cfg.get("num_warps", 4),
        )  # fmt: skip
    elif m:
        traceable(_codebook_matmul_kernel)[grid](
            x2, indices, codebook, y, ws, counts, m, n_out, k_in,
            x2.stride(0), indices.stride(0), codebook.stride(0), y.stride(0), tiles_per_split,
            BITS=bits, GROUP=group_size, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"], MODE=mode,
            DOT_FP32=interpreting() and x2.dtype == torch.bfloat16, TABLES=cfg.get("tables", bits == 4),
            ASM=not interpreting(), EVEN_K=bits == 4 and k_in % cfg["BLOCK_K"] == 0,
            num_warps=cfg.get("num_warps", 4),
            **({"num_stages": cfg["num_stages"]} if "num_stages" in cfg else {}),
        )  # fmt: skip
    return y.to(x2.dtype)


def _codebook_matmul_op(
    x: torch.Tensor, indices: torch.Tensor, codebook: torch.Tensor, group_size: int, bits: int
) -> torch.Tensor:
    """The registered op's body: dispatched eagerly (torch's ``triton_op`` runs it with ``wrap_triton``
    off), :func:`_codebook_matmul` through :data:`codebook_matmul_eager`'s launch plans."""
    if not _launch.is_wrap_triton_enabled():
        return codebook_matmul_eager.plans(_codebook_matmul, (x, indices, codebook, group_size, bits))
    return _codebook_matmul(x, indices, codebook, group_size, bits)


codebook_matmul = triton_op("squeezeserve::codebook_matmul", _codebook_matmul_op, mutates_args=())


@codebook_matmul.register_fake
def _(x, indices, codebook, group_size, bits):
    check_inputs(x, indices, codebook, group_size, bits)
    return x.new_empty((*x.shape[:-1], indices.shape[0]))


@torch.library.custom_op("squeezeserve::codebook_matmul_opaque", mutates_args=())
def codebook_matmul_opaque(
    x: torch.Tensor, indices: torch.Tensor, codebook: torch.Tensor, group_size: int, bits: int
) -> torch.Tensor:
    """``codebook_matmul`` as an opaque op for engines that compile one graph for many token counts (vLLM):
    the tile and split-K choice by row count runs on every call instead of being fixed at the traced size.
    No autograd: serving."""
    # (never traced: its launches go straight to the kernels, replayed from launch plans)
    return codebook_matmul_eager.plans(_codebook_matmul, (x, indices, codebook, group_size, bits))


@codebook_matmul_opaque.register_fake
def _(x, indices, codebook, group_size, bits):
    check_inputs(x, indices, codebook, group_size, bits)
    return x.new_empty((*x.shape[:-1], indices.shape[0]))


def _setup(ctx, inputs, output):
    x, indices, codebook, group_size, bits = inputs
    ctx.save_for_backward(indices, codebook)
    ctx.meta = (x.shape[-1], group_size, bits, x.dtype)


def _grad(ctx, grad):
    """Codebooks are frozen: only dx = grad @ W."""
    indices, codebook = ctx.saved_tensors
    k_in, group_size, bits, dtype = ctx.meta
    weight = codebook_layout.dequantize(indices, codebook, k_in, group_size or None, bits)
    return grad @ weight.to(dtype), None, None, None, None


codebook_matmul.register_autograd(_grad, setup_context=_setup)

# The op without torch's dispatcher, for the functional API's eager calls, with launch plans, which the
# registered op's eager calls and the opaque op share: as quant_matmul_eager. Preparing the launches took the
# H200 machine's host 54-104 us a call at 1-256 rows, more than the kernel at decode sizes (14-41 us;
# tests/gpu/launch_probe.py --codebook-shapes). The split-K workspace is quant_matmul's: plans hold it.
codebook_matmul_eager = EagerOp(
    _codebook_matmul, _setup, _grad, plans=LaunchPlans(persistent=workspace_buffers, max_plans=2048)
)
