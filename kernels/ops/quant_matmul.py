"""Weight-only quantized matmul: ``y = x @ dequantize(W).T`` over compressed-tensors' pack-quantized layout.

The layout is defined once, in ``kernels/quant_layout.py``: ``qweight`` int32 [N, ceil(K / P)] packed
along K (P = 32 // bits, lowest bits first, offset-binary), ``scales`` [N, ceil(K / G)], optional
``zeros`` int32 [ceil(N / P), ceil(K / G)] packed along N.

Each program owns a [BLOCK_M, BLOCK_N] output tile and walks K in BLOCK_K steps: it loads the packed
words of the tile once ([BLOCK_K / P, BLOCK_N] int32), unpacks them with shifts, dequantizes
w = (q - zero) * scale in fp32 (exact: a <=8-bit integer times a 16-bit float), rounds to the activation
dtype like compressed-tensors does, and accumulates tl.dot in fp32.

Two launch paths, both autotuned on (M bucket, N, K), one launch each (no split-K buffers to zero and
cast, which cost more than they save at these sizes under CUDA graphs):
- decode (M <= 16): narrow BLOCK_N so every SM has programs streaming the packed weight; 1-4 rows reduce
  with broadcast FMAs, 5-16 rows use a 16-row tensor-core tile.
- prefill: classic tensor-core tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from squeezeserve.kernels import quant_layout, reference
from squeezeserve.kernels.registry import interpreting, use_reference

DECODE_MAX_M = 16
# Up to this many rows the decode path reduces with broadcast FMAs instead of a 16-row tensor-core tile.
FMA_MAX_M = 4


@triton.jit
def _quant_matmul_kernel(
    x_ptr,  # [M, K] activations (fp16/bf16)
    qw_ptr,  # [N, ceil(K / PACK)] int32 packed weight
    scale_ptr,  # [N, ceil(K / GROUP)] scales
    zero_ptr,  # [ceil(N / PACK), ceil(K / GROUP)] int32 packed zero points (read only when HAS_ZERO)
    y_ptr,  # [M, N] out
    M,
    N,
    K,
    x_row_stride,
    qw_row_stride,
    scale_row_stride,
    zero_row_stride,
    y_row_stride,
    m_bucket,  # next_pow2(M), only an autotune key
    BITS: tl.constexpr,  # 4 or 8
    GROUP: tl.constexpr,  # group size (constexpr: it decides how scales are broadcast over a tile)
    HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,  # tensor cores; off for 1-4 rows, where a broadcast-FMA reduction wastes less
    DOT_FP32: tl.constexpr,  # upcast both dot operands (Triton's interpreter gets bf16 tl.dot wrong)
):
    """y[m, n] = sum_k x[m, k] W[n, k],  W[n, k] = (q[n, k] - zero[n, k // GROUP]) * scale[n, k // GROUP].

    The weight tile is [BLOCK_N, BLOCK_K] with K fastest, as the packed words lie in memory: each row of
    the tile is BLOCK_K / PACK consecutive int32 words (wide, coalesced loads), unpacked in registers by
    a shift per position and a reshape that only merges the two fastest dims.
    """
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows_n = offs_n.to(tl.int64)[:, None]
    offs_w = tl.arange(0, BLOCK_K // PACK)
    shifts = tl.arange(0, PACK) * BITS
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        words_k = k0 // PACK + offs_w
        words = tl.load(
            qw_ptr + rows_n * qw_row_stride + words_k[None, :],
            mask=mask_n[:, None] & (words_k[None, :] * PACK < K),
            other=0,
        )  # [BLOCK_N, BLOCK_K / PACK]
        q = (words[:, :, None] >> shifts[None, None, :]) & MASK  # [BLOCK_N, BLOCK_K / PACK, PACK]
        q = tl.reshape(q, [BLOCK_N, BLOCK_K])
        if GROUP % BLOCK_K == 0:
            # The whole tile is in one group: one scale (and zero) per output row.
            g = k0 // GROUP
            s = tl.load(scale_ptr + rows_n * scale_row_stride + g, mask=mask_n[:, None], other=0.0)
            s = s.to(tl.float32)
            if HAS_ZERO:
                zw = tl.load(zero_ptr + (offs_n // PACK)[:, None] * zero_row_stride + g, mask=mask_n[:, None])
                q = q - ((zw >> ((offs_n % PACK) * BITS)[:, None]) & MASK)
        elif BLOCK_K % GROUP == 0:
            # Whole groups per tile: load BLOCK_K / GROUP scales per row and repeat each GROUP times.
            GROUPS: tl.constexpr = BLOCK_K // GROUP
            g = k0 // GROUP + tl.arange(0, GROUPS)
            g_mask = mask_n[:, None] & (g[None, :] * GROUP < K)
            s = tl.load(scale_ptr + rows_n * scale_row_stride + g[None, :], mask=g_mask, other=0.0)
            s = tl.reshape(
                tl.broadcast_to(s.to(tl.float32)[:, :, None], [BLOCK_N, GROUPS, GROUP]), [BLOCK_N, BLOCK_K]
            )
            if HAS_ZERO:
                zw = tl.load(
                    zero_ptr + (offs_n // PACK)[:, None] * zero_row_stride + g[None, :], mask=g_mask, other=0
                )
                z = (zw >> ((offs_n % PACK) * BITS)[:, None]) & MASK
                q = q - tl.reshape(
                    tl.broadcast_to(z[:, :, None], [BLOCK_N, GROUPS, GROUP]), [BLOCK_N, BLOCK_K]
                )
        else:
            # Groups that straddle tiles: the scale of every k.
            g = offs_k // GROUP
            s = tl.load(
                scale_ptr + rows_n * scale_row_stride + g[None, :],
                mask=mask_n[:, None] & mask_k[None, :],
                other=0.0,
            ).to(tl.float32)
            if HAS_ZERO:
                zw = tl.load(
                    zero_ptr + (offs_n // PACK)[:, None] * zero_row_stride + g[None, :],
                    mask=mask_n[:, None] & mask_k[None, :],
                    other=0,
                )
                q = q - ((zw >> ((offs_n % PACK) * BITS)[:, None]) & MASK)
        if not HAS_ZERO:
            q = q - OFFSET
        # Exact in fp32 (an integer of <= 8 bits times a 16-bit float), then one rounding to the activation
        # dtype: the weight compressed-tensors' dequantize would produce.
        w = tl.where(mask_k[None, :], q.to(tl.float32) * s, 0.0).to(x_ptr.dtype.element_ty)
        a = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * x_row_stride + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        if USE_DOT:
            if DOT_FP32:
                # Exact: the operands are bf16 values, their products fit fp32.
                acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        else:
            acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * y_row_stride + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _config(bn: int, bk: int, warps: int, stages: int, bm: int | None = None) -> triton.Config:
    meta = {"BLOCK_N": bn, "BLOCK_K": bk} | ({} if bm is None else {"BLOCK_M": bm})
    return triton.Config(meta, num_warps=warps, num_stages=stages)


# Decode: (BLOCK_N, BLOCK_K, warps, stages); BLOCK_M comes from the launcher (1-4 rows: FMA; else 16 and
# tensor cores). Small BLOCK_N keeps >= 1 program per SM even at N = 4096; long BLOCK_K keeps bytes in
# flight. Prefill: (BLOCK_N, BLOCK_K, warps, stages, BLOCK_M). Under the interpreter one config each:
# autotuning would only multiply the test time.
_DECODE_CONFIGS = [
    _config(*c)
    for c in [
        (16, 256, 2, 4), (16, 512, 4, 3), (32, 128, 4, 4), (32, 256, 4, 4), (32, 512, 4, 3),
        (64, 128, 4, 4), (64, 256, 4, 3), (64, 256, 8, 3), (16, 128, 2, 5), (128, 128, 8, 3),
    ]
]  # fmt: skip
_PREFILL_CONFIGS = [
    _config(*c)
    for c in [
        (128, 64, 4, 4, 64), (128, 64, 8, 3, 128), (256, 64, 8, 3, 128), (128, 128, 8, 3, 128),
        (64, 128, 4, 4, 64),
    ]
]  # fmt: skip
if interpreting():
    _DECODE_CONFIGS, _PREFILL_CONFIGS = _DECODE_CONFIGS[2:3], _PREFILL_CONFIGS[:1]
_KEY = ["m_bucket", "N", "K"]
_decode_kernel = triton.autotune(_DECODE_CONFIGS, key=_KEY)(_quant_matmul_kernel)
_prefill_kernel = triton.autotune(_PREFILL_CONFIGS, key=_KEY)(_quant_matmul_kernel)


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
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m:
        args = (
            x2, qweight, scales, zero_arg, y, m, n_out, k_in,
            x2.stride(0), qweight.stride(0), scales.stride(0), zero_arg.stride(0), y.stride(0),
            triton.next_power_of_2(m),
        )  # fmt: skip
        flags = {"BITS": bits, "GROUP": group_size, "HAS_ZERO": zeros is not None}
        flags["DOT_FP32"] = interpreting() and x.dtype == torch.bfloat16
        if m <= DECODE_MAX_M:
            block_m = triton.next_power_of_2(m) if m <= FMA_MAX_M else 16
            grid = lambda meta: (triton.cdiv(m, block_m), triton.cdiv(n_out, meta["BLOCK_N"]))  # noqa: E731
            wrap_triton(_decode_kernel)[grid](*args, **flags, BLOCK_M=block_m, USE_DOT=m > FMA_MAX_M)
        else:
            grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n_out, meta["BLOCK_N"]))  # noqa: E731
            wrap_triton(_prefill_kernel)[grid](*args, **flags, USE_DOT=True)
    return y.reshape(*x.shape[:-1], n_out)


quant_matmul = triton_op("squeezeserve::quant_matmul", _quant_matmul, mutates_args=())


@quant_matmul.register_fake
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
