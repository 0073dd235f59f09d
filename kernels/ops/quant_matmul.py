"""Weight-only quantized matmul: ``y = x @ dequantize(W).T`` over compressed-tensors' pack-quantized layout.

The layout is defined once, in ``kernels/quant_layout.py``: ``qweight`` int32 [N, ceil(K / P)] packed
along K (P = 32 // bits, lowest bits first, offset-binary), ``scales`` [N, ceil(K / G)], optional
``zeros`` int32 [ceil(N / P), ceil(K / G)] packed along N.

Each program owns a [BLOCK_M, BLOCK_N] output tile and walks K in BLOCK_K steps: it loads the packed
words of the tile once ([BLOCK_K / P, BLOCK_N] int32), unpacks them with shifts, dequantizes
w = (q - zero) * scale in fp32 (exact: a <=8-bit integer times a 16-bit float), rounds to the activation
dtype like compressed-tensors does, and accumulates tl.dot in fp32.

Two launch paths, both autotuned on (N, K):
- decode (M <= 16): BLOCK_M = 16 and split-K: SPLIT_K programs share an output tile, each takes a slice of
  K, and they atomically add fp32 partials into a zeroed buffer. With few rows the work is streaming the
  packed weight, so the grid must be wide enough to keep every SM loading.
- prefill: classic tiles, no split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from squeezeserve.kernels import quant_layout, reference
from squeezeserve.kernels.registry import interpreting, use_reference

DECODE_MAX_M = 16


@triton.jit
def _quant_matmul_kernel(
    x_ptr,  # [M, K] activations (fp16/bf16)
    qw_ptr,  # [N, ceil(K / PACK)] int32 packed weight
    scale_ptr,  # [N, ceil(K / GROUP)] scales
    zero_ptr,  # [ceil(N / PACK), ceil(K / GROUP)] int32 packed zero points (read only when HAS_ZERO)
    y_ptr,  # [M, N] out: output dtype, or fp32 partial sums when SPLIT_K > 1
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
    SPLIT_K: tl.constexpr,
    ATOMIC: tl.constexpr,  # accumulate into y with atomic adds (split-K)
    DOT_FP32: tl.constexpr,  # upcast both dot operands (Triton's interpreter gets bf16 tl.dot wrong)
):
    """y[m, n] = sum_k x[m, k] W[n, k],  W[n, k] = (q[n, k] - zero[n, k // GROUP]) * scale[n, k // GROUP]."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    offs_w = tl.arange(0, BLOCK_K // PACK)  # packed word index within the tile
    shifts = tl.arange(0, PACK) * BITS
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        a = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * x_row_stride + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        words_k = k0 // PACK + offs_w
        words = tl.load(
            qw_ptr + offs_n[None, :].to(tl.int64) * qw_row_stride + words_k[:, None],
            mask=mask_n[None, :] & (words_k[:, None] * PACK < k_end),
            other=0,
        )  # [BLOCK_K / PACK, BLOCK_N]
        q = (words[:, None, :] >> shifts[None, :, None]) & MASK  # [BLOCK_K / PACK, PACK, BLOCK_N]
        q = tl.reshape(q, [BLOCK_K, BLOCK_N])
        if GROUP % BLOCK_K == 0:
            # The whole tile is in one group: one scale (and zero) per column.
            g = k0 // GROUP
            s = tl.load(scale_ptr + offs_n.to(tl.int64) * scale_row_stride + g, mask=mask_n, other=0.0)
            s = s.to(tl.float32)[None, :]
            if HAS_ZERO:
                zw = tl.load(zero_ptr + (offs_n // PACK) * zero_row_stride + g, mask=mask_n, other=0)
                z = ((zw >> ((offs_n % PACK) * BITS)) & MASK)[None, :]
        else:
            # Several groups (or a group that straddles tiles): gather the scale of every k.
            g = offs_k // GROUP
            s = tl.load(
                scale_ptr + offs_n[None, :].to(tl.int64) * scale_row_stride + g[:, None],
                mask=mask_n[None, :] & mask_k[:, None],
                other=0.0,
            ).to(tl.float32)
            if HAS_ZERO:
                zw = tl.load(
                    zero_ptr + (offs_n // PACK)[None, :] * zero_row_stride + g[:, None],
                    mask=mask_n[None, :] & mask_k[:, None],
                    other=0,
                )
                z = (zw >> ((offs_n % PACK) * BITS)[None, :]) & MASK
        if HAS_ZERO:
            w = (q - z).to(tl.float32) * s
        else:
            w = (q - OFFSET).to(tl.float32) * s
        w = tl.where(mask_k[:, None], w, 0.0).to(x_ptr.dtype.element_ty)
        if DOT_FP32:
            # Exact: the operands are bf16 values, their products fit fp32.
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * y_row_stride + offs_n[None, :]
    y_mask = mask_m[:, None] & mask_n[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=y_mask, sem="relaxed")
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def _config(bm: int, bn: int, bk: int, split: int, warps: int, stages: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split}, num_warps=warps, num_stages=stages
    )


# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages). Under the interpreter one config: autotuning would
# only multiply the test time.
_DECODE_CONFIGS = [
    _config(16, bn, bk, split, 4, stages)
    for bn, bk, split, stages in [
        (32, 128, 1, 4), (32, 256, 1, 3), (64, 128, 1, 4), (64, 256, 1, 3),
        (32, 128, 2, 4), (64, 128, 2, 4), (64, 256, 2, 3), (128, 128, 2, 3),
        (32, 256, 4, 3), (64, 128, 4, 4), (128, 128, 4, 3), (64, 128, 8, 4),
    ]
]  # fmt: skip
_PREFILL_CONFIGS = [
    _config(bm, bn, bk, 1, warps, stages)
    for bm, bn, bk, warps, stages in [
        (64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3),
        (64, 64, 128, 4, 4),
    ]
]  # fmt: skip
if interpreting():
    _DECODE_CONFIGS, _PREFILL_CONFIGS = _DECODE_CONFIGS[:1], _PREFILL_CONFIGS[:1]
_DECODE_KEY = ["N", "K"]  # every M <= 16 runs the same BLOCK_M = 16 tiles
_KEY = ["m_bucket", "N", "K"]
_decode_kernel = triton.autotune(_DECODE_CONFIGS, key=_DECODE_KEY, reset_to_zero=["y_ptr"])(
    _quant_matmul_kernel
)
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
    decode = m <= DECODE_MAX_M
    y = torch.zeros((m, n_out), dtype=torch.float32 if decode else x.dtype, device=x.device)
    if m:
        kernel = _decode_kernel if decode else _prefill_kernel

        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n_out, meta["BLOCK_N"]), meta["SPLIT_K"])

        wrap_triton(kernel)[grid](
            x2, qweight, scales, zero_arg, y, m, n_out, k_in,
            x2.stride(0), qweight.stride(0), scales.stride(0), zero_arg.stride(0), y.stride(0),
            triton.next_power_of_2(m), BITS=bits, GROUP=group_size, HAS_ZERO=zeros is not None, ATOMIC=decode,
            DOT_FP32=interpreting() and x.dtype == torch.bfloat16,
        )  # fmt: skip
    return y.to(x.dtype).reshape(*x.shape[:-1], n_out)


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
