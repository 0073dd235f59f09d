"""Weight-sharing matmul, ``squeezeserve::codebook_matmul``: ``y = x @ W.T`` with every weight looked up in
its row's codebook inside the kernel (``kernels/codebook_layout.py`` defines the layout).

Two kernels; in both a program owns BLOCK_N output rows and a run of K tiles (split-K when the N tiles
alone would leave SMs idle), and the dequantized weight never exists in global memory. One row (decode)
takes the word-wise LUT kernel (``_codebook_lut_kernel``: weights loaded from the codebook in L1, a
multiply-and-sum on the FMA units). More rows take the gather kernel: its rows' codebooks (E = 2**bits
values each, per channel or per K tile's group) are loaded into registers; per K tile the packed indices
are unpacked with shifts and ``tl.gather`` turns them into weight values [BLOCK_N, BLOCK_K] in registers
(a warp shuffle, or shared memory where the compiler needs it), the A operand of a tensor-core ``tl.dot``
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
from squeezeserve.kernels.ops.launch import cdiv, sm_count, traceable
from squeezeserve.kernels.ops.quant_matmul import _workspace
from squeezeserve.kernels.ops.quant_matmul_kernels import _unpack, _write_tile
from squeezeserve.kernels.registry import direct_launches, eager, interpreting, use_reference


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
    dtype = x_ptr.dtype.element_ty
    if GROUP == 0:  # the rows' codebooks stay in registers for the whole K range
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
            codebook = tl.load(cb_rows + group * E + offs_e[None, :], mask=mask_n[:, None], other=0.0)
        if PER_WORD * BITS == 32:  # 4 bits: a tile is whole words, loaded once and split in registers
            offs_w = tile * W + tl.arange(0, W)
            words = tl.load(
                idx_rows + offs_w[None, :], mask=mask_n[:, None] & (offs_w < n_words)[None, :], other=0
            )
            index = _unpack(words, BLOCK_N, BLOCK_K, BITS)
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
    """Tile sizes and split-K for ``m`` rows on a GPU with ``sms`` SMs (None: Triton's interpreter, small
    tiles). A pure function, so tests run the GPU's choice on any backend.

    One row takes the word-wise LUT kernel (``kernel: lut``) with 4 output rows and 64 index words a
    program, split over K only where the N tiles leave SMs idle: of 12 settings swept on the H100
    (``tests/gpu/codebook_lut_sweep.py``, 2026-11-23), the best or within 1% of it at five of six decode
    (shape, bits) points and 11% behind at 3 bits with K = 14336; 2.2-3.0x the gather kernel there.
    Several rows take the gather kernel's tensor-core path, whose K tile must lie inside one codebook group;
    K is split until the grid fills the GPU twice over (decode shapes have few N tiles)."""
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
    split = max(1, min(tiles, cdiv(2 * sms, programs)))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "split": split}


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
    ``kernel: lut`` with BLOCK_W index words a tile for one row, else the gather kernel with BLOCK_K; a
    probe may add ``num_warps``, ``num_stages``, or ``mode`` to pick how split-K partials meet,
    ``_write_tile``'s MODE)."""
    n_out, k_in = indices.shape[0], x2.shape[-1]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    indices, codebook = indices.contiguous(), codebook.contiguous()
    lut = cfg.get("kernel") == "lut"
    tiles = cdiv(cdiv(k_in, 32 // bits), cfg["BLOCK_W"]) if lut else cdiv(k_in, cfg["BLOCK_K"])
    tiles_per_split = cdiv(tiles, cfg["split"])
    split = cdiv(tiles, tiles_per_split)
    grid = (cdiv(n_out, cfg["BLOCK_N"]), cdiv(m, cfg["BLOCK_M"]), split)
    # Split-K partials meet as quant_matmul's do: in its self-cleaning workspace (one launch, no memset or
    # cast kernel, which at decode sizes would cost as much as the matmul) unless torch may be tracing.
    mode = 0 if split == 1 else cfg.get("mode", 2 if eager(x2, indices, codebook) else 1)
    y_dtype = torch.float32 if mode == 1 else x2.dtype
    y = (torch.zeros if mode == 1 else torch.empty)((m, n_out), dtype=y_dtype, device=x2.device)
    ws, counts = _workspace(x2.device, m * n_out, grid[0] * grid[1]) if mode == 2 and m else (y, y)
    if m and lut:
        if m != 1:
            raise ValueError(f"codebook_matmul: the LUT kernel takes one row, got {m}")
        traceable(_codebook_lut_kernel)[grid](
            x2, indices, codebook, y, ws, counts, n_out, k_in, indices.stride(0), codebook.stride(0),
            tiles_per_split, BITS=bits, GROUP=group_size, BLOCK_N=cfg["BLOCK_N"], BLOCK_W=cfg["BLOCK_W"],
            MODE=mode, num_warps=cfg.get("num_warps", 4),
            **({"num_stages": cfg["num_stages"]} if "num_stages" in cfg else {}),
        )  # fmt: skip
    elif m:
        traceable(_codebook_matmul_kernel)[grid](
            x2, indices, codebook, y, ws, counts, m, n_out, k_in,
            x2.stride(0), indices.stride(0), codebook.stride(0), y.stride(0), tiles_per_split,
            BITS=bits, GROUP=group_size, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"], MODE=mode,
            DOT_FP32=interpreting() and x2.dtype == torch.bfloat16, num_warps=cfg.get("num_warps", 4),
            **({"num_stages": cfg["num_stages"]} if "num_stages" in cfg else {}),
        )  # fmt: skip
    return y.to(x2.dtype)


codebook_matmul = triton_op("squeezeserve::codebook_matmul", _codebook_matmul, mutates_args=())


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
    with direct_launches:  # never traced: launch the kernels directly, not through the HOP
        return _codebook_matmul(x, indices, codebook, group_size, bits)


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
