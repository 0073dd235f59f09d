"""RMSNorm, ``rmsnorm(x, w, eps)``, and the fused residual form ``add_rmsnorm(x, residual, w, eps)``.

One program per row, the whole row in one block (rows up to 65536 wide), statistics in fp32. The
forward keeps Hugging Face's rounding: the normalised row is cast to the input dtype before the weight
multiplies it. ``fused_rounding=True`` rounds only the outputs instead (x + residual and the normalised
row stay fp32), as a torch.compile-fused RMSNorm does (vLLM's compiled path; kernels/vllm_ops.py). The
backward recomputes 1/rms from x instead of saving it (one extra reduction, no extra tensor) and reduces dw
in per-program fp32 partial sums.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from squeezeserve.kernels import reference
from squeezeserve.kernels.ops.launch import (
    block_rows,
    cdiv,
    lets_dependents_start,
    num_warps_for,
    persistent_programs,
    row_block,
    rows_2d,
    traceable,
)
from squeezeserve.kernels.ops.replay import LaunchPlans
from squeezeserve.kernels.registry import EagerOp, use_reference


@triton.jit
def _rmsnorm_fwd(
    x_ptr,  # [rows, n] input
    res_ptr,  # [rows, n] residual (read only when HAS_RESIDUAL)
    h_ptr,  # [rows, n] out: x + residual (written only when HAS_RESIDUAL)
    w_ptr,  # [n] weight
    y_ptr,  # [rows, n] out: normalised row times weight
    x_row_stride,
    res_row_stride,
    h_row_stride,
    y_row_stride,
    n_cols,
    eps,
    n_rows,
    BLOCK_R: tl.constexpr,  # rows per program (several for narrow rows)
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,  # fused residual add: h = x + residual, normalise h
    FUSED_ROUNDING: tl.constexpr,  # round only the stored outputs (Inductor's numerics), not h and h * r
    LAUNCH_DEPENDENTS: tl.constexpr,  # launch.launches_dependents: a PDL dependent may start now
    WAIT: tl.constexpr,  # launched as a programmatic dependent: wait for the kernel before, first
):
    """h = x (+ residual, in the input dtype); r = rsqrt(mean(h^2) + eps) in fp32;
    y = w * cast_to_input_dtype(h * r). FUSED_ROUNDING: h and h * r stay fp32, y = w * h * r."""
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    if WAIT:  # (before any load or store: x, and this kernel's outputs, may still be the kernel before's)
        tl.extra.cuda.gdc_wait()
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    hf = tl.load(x_ptr + rows * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # One rounding of the exact fp32 sum, as the eager add does.
        hf += tl.load(res_ptr + rows * res_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        h = hf.to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + rows * h_row_stride + cols, h, mask=mask)
        if not FUSED_ROUNDING:
            hf = h.to(tl.float32)
    r = tl.rsqrt(tl.sum(hf * hf, axis=1) / n_cols + eps)[:, None]
    normed = hf * r
    if not FUSED_ROUNDING:
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows * y_row_stride + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_bwd(
    dy_ptr,  # [rows, n] upstream gradient of y
    x_ptr,  # [rows, n] the normalised input (h for add_rmsnorm)
    w_ptr,  # [n] weight
    dres_ptr,  # [rows, n] gradient arriving at h directly (read only when HAS_DRES)
    dx_ptr,  # [rows, n] out: gradient of x
    dw_partial_ptr,  # [programs, n] fp32 out: this program's share of dw
    dy_row_stride,
    x_row_stride,
    dres_row_stride,
    dx_row_stride,
    n_rows,
    n_cols,
    rows_per_program,
    eps,
    BLOCK_R: tl.constexpr,  # rows per step of a program's loop
    BLOCK: tl.constexpr,
    HAS_DRES: tl.constexpr,
):
    """r = rsqrt(mean(x^2) + eps), xhat = x r, gw = dy w:
    dx = r (gw - xhat mean(gw xhat)) (+ dres),  dw = sum_rows dy xhat."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)[None, :]
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_R, BLOCK], dtype=tl.float32)
    # int64 row indices: rows * n can pass 2**31 elements.
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for first in range(row_start, row_end, BLOCK_R):
        rows = first + tl.arange(0, BLOCK_R)[:, None]
        mask = (rows < row_end) & col_mask
        x = tl.load(x_ptr + rows * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)[:, None]
        xhat = x * r
        gw = dy * w
        dx = r * (gw - xhat * (tl.sum(gw * xhat, axis=1) / n_cols)[:, None])
        if HAS_DRES:
            dx += tl.load(dres_ptr + rows * dres_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(dw_partial_ptr + pid * n_cols + cols, tl.sum(dw, axis=0)[None, :], mask=col_mask)


def _check(x: torch.Tensor, weight: torch.Tensor, op: str) -> None:
    if weight.dim() != 1 or x.dim() == 0 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{op}: weight must be [n] matching x's last dim, got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    row_block(x.shape[-1], op)


def _forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    fused_rounding: bool,
    dependent: bool = False,
):
    """(y, h); ``dependent``: launched as a programmatic dependent of the kernel before it (PDL: it may
    start while that one runs and waits for it in the kernel; :data:`rmsnorm_dependent`)."""
    n = x.shape[-1]
    block = row_block(n, "rmsnorm")
    x2 = rows_2d(x)
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    y2 = y.view(-1, n)
    h = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    res2 = rows_2d(residual) if residual is not None else x2
    h2 = h.view(-1, n) if h is not None else x2
    rows = x2.shape[0]
    if rows:
        rows_per_program = block_rows(rows, block)
        traceable(_rmsnorm_fwd)[(cdiv(rows, rows_per_program),)](
            x2, res2, h2, weight, y2,
            x2.stride(0), res2.stride(0), h2.stride(0), y2.stride(0),
            n, eps, rows, BLOCK_R=rows_per_program, BLOCK=block, HAS_RESIDUAL=residual is not None,
            FUSED_ROUNDING=fused_rounding, LAUNCH_DEPENDENTS=lets_dependents_start(x), WAIT=dependent,
            num_warps=num_warps_for(block), **({"launch_pdl": True} if dependent else {}),
        )  # fmt: skip
    return y, h


def _backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, dres: torch.Tensor | None
):
    n = x.shape[-1]
    block = row_block(n, "rmsnorm")
    x2, g2 = rows_2d(x), rows_2d(grad)
    dres2 = rows_2d(dres) if dres is not None else g2
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dx2 = dx.view(-1, n)
    rows = x2.shape[0]
    programs = persistent_programs(x.device, rows)
    dw_partial = torch.zeros((programs, n), dtype=torch.float32, device=x.device)
    if rows:
        traceable(_rmsnorm_bwd)[(programs,)](
            g2, x2, weight, dres2, dx2, dw_partial,
            g2.stride(0), x2.stride(0), dres2.stride(0), dx2.stride(0),
            rows, n, cdiv(rows, programs), eps,
            BLOCK_R=block_rows(rows, block), BLOCK=block, HAS_DRES=dres is not None,
            num_warps=num_warps_for(block),
        )  # fmt: skip
    return dx, dw_partial.sum(0).to(weight.dtype)


def _fused_rounding_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_rounding`` on CPU: vLLM's RMSNorm IR ops as Inductor fuses them, rounding only (y, h)."""
    h = x.float() if residual is None else x.float() + residual.float()
    y = weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))
    return y.to(torch.promote_types(x.dtype, weight.dtype)), h.to(x.dtype)


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused_rounding: bool = False) -> torch.Tensor:
    _check(x, weight, "rmsnorm")
    if use_reference(x):
        if fused_rounding:
            return _fused_rounding_reference(x, None, weight, eps)[0]
        return reference.rmsnorm(x, weight, eps)
    return _forward(x, None, weight, eps, fused_rounding)[0]


def _rmsnorm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_reference(x):
        return reference.rmsnorm_backward(grad, x, weight, eps)
    return _backward(grad, x, weight, eps, None)


def _add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, fused_rounding: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, weight, "add_rmsnorm")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"add_rmsnorm: residual must match x, got {tuple(residual.shape)} {residual.dtype} "
            f"and {tuple(x.shape)} {x.dtype}"
        )
    if use_reference(x):
        if fused_rounding:
            return _fused_rounding_reference(x, residual, weight, eps)
        return reference.add_rmsnorm(x, residual, weight, eps)
    return _forward(x, residual, weight, eps, fused_rounding)


def _add_rmsnorm_backward(
    grad_y: torch.Tensor, grad_h: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient at h = rmsnorm backward + grad arriving at the returned residual; x and residual share it."""
    if use_reference(h):
        dh, dw = reference.rmsnorm_backward(grad_y, h, weight, eps)
        return (dh.float() + grad_h.float()).to(h.dtype), dw
    return _backward(grad_y, h, weight, eps, grad_h)


rmsnorm = triton_op("squeezeserve::rmsnorm", _rmsnorm, mutates_args=())
rmsnorm_backward = triton_op("squeezeserve::rmsnorm_backward", _rmsnorm_backward, mutates_args=())
add_rmsnorm = triton_op("squeezeserve::add_rmsnorm", _add_rmsnorm, mutates_args=())
add_rmsnorm_backward = triton_op("squeezeserve::add_rmsnorm_backward", _add_rmsnorm_backward, mutates_args=())


@rmsnorm.register_fake
def _(x, weight, eps, fused_rounding=False):
    _check(x, weight, "rmsnorm")
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@rmsnorm_backward.register_fake
def _(grad, x, weight, eps):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


@add_rmsnorm.register_fake
def _(x, residual, weight, eps, fused_rounding=False):
    _check(x, weight, "add_rmsnorm")
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)), x.new_empty(x.shape)


@add_rmsnorm_backward.register_fake
def _(grad_y, grad_h, h, weight, eps):
    return h.new_empty(h.shape), weight.new_empty(weight.shape)


def _rmsnorm_setup(ctx, inputs, output):
    x, weight, eps = inputs[:3]
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rmsnorm_grad(ctx, grad, backward=rmsnorm_backward):
    x, weight = ctx.saved_tensors
    dx, dw = backward(grad, x, weight, ctx.eps)
    return dx, dw, None, None


def _add_rmsnorm_setup(ctx, inputs, output):
    _, _, weight, eps = inputs[:4]
    ctx.save_for_backward(output[1], weight)
    ctx.eps = eps


def _add_rmsnorm_grad(ctx, grad_y, grad_h, backward=add_rmsnorm_backward):
    h, weight = ctx.saved_tensors
    if grad_h is None:
        grad_h = torch.zeros_like(h)
    dh, dw = backward(grad_y, grad_h, h, weight, ctx.eps)
    return dh, dh, dw, None, None


rmsnorm.register_autograd(_rmsnorm_grad, setup_context=_rmsnorm_setup)
add_rmsnorm.register_autograd(_add_rmsnorm_grad, setup_context=_add_rmsnorm_setup)

# The same bodies and formulas for eager calls, without the dispatcher (registry.EagerOp).
# Calls without gradients replay their recorded launches (replay.LaunchPlans).
rmsnorm_eager = EagerOp(
    _rmsnorm, _rmsnorm_setup, partial(_rmsnorm_grad, backward=_rmsnorm_backward), plans=LaunchPlans()
)
add_rmsnorm_eager = EagerOp(
    _add_rmsnorm,
    _add_rmsnorm_setup,
    partial(_add_rmsnorm_grad, backward=_add_rmsnorm_backward),
    plans=LaunchPlans(),
)


def _rmsnorm_dependent(
    x: torch.Tensor, weight: torch.Tensor, eps: float, fused_rounding: bool = False
) -> torch.Tensor:
    _check(x, weight, "rmsnorm")
    return _forward(x, None, weight, eps, fused_rounding, dependent=True)[0]


def _add_rmsnorm_dependent(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, fused_rounding: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, weight, "add_rmsnorm")
    return _forward(x, residual, weight, eps, fused_rounding, dependent=True)


# Serving only (no autograd), on a Hopper GPU while a CUDA graph captures (launch.graph_dependent; vLLM's
# decode graphs through vllm_ops): the forwards launched as programmatic dependents of the kernel before
# them, which in a decoder layer is our GEMM (it calls launch_dependents first). The norm starts while that
# GEMM drains and lets the next GEMM start too: that one's weight loads then overlap the previous GEMM's end
# across the norm. H100, tests/gpu/pdl_probe.py --after-norm --chain (NOTES.md, twenty-fifth session): a
# 14336 x 4096 decode GEMM and such a norm 17.4-19.0 us a step at 1-16 rows against 19.4-20.4 with our norm
# launched plainly (28672 x 4096: 28.3-30.7 against 31.4-33.5).
rmsnorm_dependent = EagerOp(_rmsnorm_dependent, _rmsnorm_setup, _rmsnorm_grad, plans=LaunchPlans())
add_rmsnorm_dependent = EagerOp(
    _add_rmsnorm_dependent, _add_rmsnorm_setup, _add_rmsnorm_grad, plans=LaunchPlans()
)


def warm_rows(n: int) -> tuple[int, ...]:
    """The fewest row counts whose forwards at width ``n`` launch every compiled kernel (launch key) that
    the row counts up to 1024 launch: the first row count of each rows-a-program tiling that is 1, a
    multiple of 16 or neither (what Triton specializes the row count on)."""
    block = row_block(n, "rmsnorm")
    first: dict[tuple, int] = {}
    for rows in range(1, 1025):
        first.setdefault((block_rows(rows, block), rows == 1, rows % 16 == 0), rows)
    return tuple(sorted(first.values()))
