"""Softmax over the last dim, forward and backward.

Rows up to ``SINGLE_BLOCK_COLS`` (65536, Liger's limit) sit in one block, several narrow rows per
program: one read, one write. Wider rows (a 128k vocabulary) take the online path, one program
per row (the kernel can also walk rows persistently, but one program per SM measured 34% slower at
4096 x 131072 on the H100): pass 1 streams the row once keeping a running max m and a running sum
d = sum exp(x - m) (rescaled by exp(m_old - m_new) when the max grows), pass 2 reads it again and
writes exp(x - m) / d. No limit on the row width.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from squeezeserve.kernels import reference
from squeezeserve.kernels.ops.launch import block_rows, num_warps_for, rows_2d
from squeezeserve.kernels.registry import EagerOp, use_reference

SINGLE_BLOCK_COLS = 65536
ONLINE_BLOCK = 8192


@triton.jit
def _softmax_fwd(
    x_ptr,  # [rows, n] input
    y_ptr,  # [rows, n] out: softmax(x)
    x_row_stride,
    y_row_stride,
    n_cols,
    n_rows,
    BLOCK_R: tl.constexpr,  # rows per program (SINGLE only)
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,  # the row fits one block
):
    """m = max x, d = sum exp(x - m), y = exp(x - m) / d (online m, d over blocks when not SINGLE)."""
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
        mask = (rows < n_rows) & (cols[None, :] < n_cols)
        x = tl.load(x_ptr + rows * x_row_stride + cols[None, :], mask=mask, other=-float("inf")).to(
            tl.float32
        )
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        y = e / tl.sum(e, axis=1)[:, None]
        tl.store(y_ptr + rows * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # One program per row (a persistent one-program-per-SM loop measured 34% slower at 4096 x 131072).
        for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
            x_row = x_ptr + row * x_row_stride
            y_row = y_ptr + row * y_row_stride
            m = -float("inf")
            d = 0.0
            for start in range(0, n_cols, BLOCK):
                mask = start + cols < n_cols
                x = tl.load(x_row + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
                m_new = tl.maximum(m, tl.max(x, axis=0))
                d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
                m = m_new
            for start in range(0, n_cols, BLOCK):
                mask = start + cols < n_cols
                x = tl.load(x_row + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
                tl.store(y_row + start + cols, (tl.exp(x - m) / d).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd(
    dy_ptr,  # [rows, n] upstream gradient
    y_ptr,  # [rows, n] softmax output
    dx_ptr,  # [rows, n] out
    dy_row_stride,
    y_row_stride,
    dx_row_stride,
    n_cols,
    n_rows,
    BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,
):
    """dx = y (dy - sum(dy y))."""
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
        mask = (rows < n_rows) & (cols[None, :] < n_cols)
        dy = tl.load(dy_ptr + rows * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + rows * y_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dx = y * (dy - tl.sum(dy * y, axis=1)[:, None])
        tl.store(dx_ptr + rows * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    else:
        for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
            dot = 0.0
            for start in range(0, n_cols, BLOCK):
                mask = start + cols < n_cols
                dy = tl.load(dy_ptr + row * dy_row_stride + start + cols, mask=mask, other=0.0).to(tl.float32)
                y = tl.load(y_ptr + row * y_row_stride + start + cols, mask=mask, other=0.0).to(tl.float32)
                dot += tl.sum(dy * y, axis=0)
            for start in range(0, n_cols, BLOCK):
                mask = start + cols < n_cols
                dy = tl.load(dy_ptr + row * dy_row_stride + start + cols, mask=mask, other=0.0).to(tl.float32)
                y = tl.load(y_ptr + row * y_row_stride + start + cols, mask=mask, other=0.0).to(tl.float32)
                dx = y * (dy - dot)
                tl.store(
                    dx_ptr + row * dx_row_stride + start + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask
                )


def launch_config(n_cols: int) -> tuple[int, bool, int]:
    """(block, single, num_warps) for rows of ``n_cols``: one block when it fits, else the online path."""
    if n_cols < 1:
        raise ValueError(f"softmax: the last dimension must be at least 1, got {n_cols}")
    single = n_cols <= SINGLE_BLOCK_COLS
    block = triton.next_power_of_2(n_cols) if single else ONLINE_BLOCK
    return block, single, num_warps_for(block)


def _softmax(x: torch.Tensor) -> torch.Tensor:
    if use_reference(x):
        return reference.softmax(x)
    x2 = rows_2d(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, x.shape[-1])
    block, single, warps = launch_config(x.shape[-1])
    rows = x2.shape[0]
    if rows:
        programs = triton.cdiv(rows, block_rows(rows, block)) if single else rows
        wrap_triton(_softmax_fwd)[(programs,)](
            x2, y2, x2.stride(0), y2.stride(0), x.shape[-1], rows,
            BLOCK_R=block_rows(rows, block) if single else 1, BLOCK=block, SINGLE=single, num_warps=warps,
        )  # fmt: skip
    return y


def _softmax_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if use_reference(y):
        return reference.softmax_backward(grad, y)
    g2, y2 = rows_2d(grad), rows_2d(y)
    dx = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    dx2 = dx.view(-1, y.shape[-1])
    block, single, warps = launch_config(y.shape[-1])
    rows = y2.shape[0]
    if rows:
        programs = triton.cdiv(rows, block_rows(rows, block)) if single else rows
        wrap_triton(_softmax_bwd)[(programs,)](
            g2, y2, dx2, g2.stride(0), y2.stride(0), dx2.stride(0), y.shape[-1], rows,
            BLOCK_R=block_rows(rows, block) if single else 1, BLOCK=block, SINGLE=single, num_warps=warps,
        )  # fmt: skip
    return dx


softmax = triton_op("squeezeserve::softmax", _softmax, mutates_args=())
softmax_backward = triton_op("squeezeserve::softmax_backward", _softmax_backward, mutates_args=())


@softmax.register_fake
def _(x):
    launch_config(x.shape[-1] if x.dim() else 0)
    return x.new_empty(x.shape)


@softmax_backward.register_fake
def _(grad, y):
    return y.new_empty(y.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _grad(ctx, grad, backward=softmax_backward):
    (y,) = ctx.saved_tensors
    return (backward(grad, y),)


softmax.register_autograd(_grad, setup_context=_setup)
# The same body and formula for eager calls, without the dispatcher (registry.EagerOp).
softmax_eager = EagerOp(_softmax, _setup, partial(_grad, backward=_softmax_backward))
