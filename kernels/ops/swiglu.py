"""SwiGLU: ``swiglu(gate, up)``, vLLM's packed ``silu_and_mul(x)`` and gpt-oss's ``swiglu_oai``.

Elementwise and memory-bound: one flat kernel per form, fp32 math, one rounding at the store. The packed
form reads gate and up as the two halves of each row of x, so it shares the kernels through strides.
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
    next_power_of_2,
    rows_2d,
    traceable,
)
from squeezeserve.kernels.ops.replay import LaunchPlans
from squeezeserve.kernels.registry import EagerOp, use_reference

# Columns per program; a 2-D grid of [rows, columns] tiles keeps each row contiguous for the packed form.
BLOCK = 1024
# Large shapes (at least BIG_GRID programs of one row each) take one row a program, up to BIG_BLOCK columns
# (BIG_BLOCK_BWD in the backward), on 16 warps: at 16384 x 4096 and 16384 x 14336 (bf16, H100,
# tests/gpu/swiglu_probe.py) the forward streams 2976-2988 GB/s against 2858-2913 on BLOCK-wide tiles of
# two rows and 4 warps, the backward 2980-3039 against 2852-2897 (Liger's fwd+bwd: 2921-3005).
BIG_GRID, BIG_BLOCK, BIG_BLOCK_BWD, BIG_WARPS = 1024, 8192, 16384, 16


@triton.jit
def _swiglu_fwd(
    gate_ptr,  # [rows, d] gate (the silu input)
    up_ptr,  # [rows, d] up
    out_ptr,  # [rows, d] silu(gate) * up
    gate_row_stride,
    up_row_stride,
    out_row_stride,
    n_cols,  # d
    alpha,  # gpt-oss sigmoid slope (OAI only)
    limit,  # gpt-oss clamp limit (OAI only)
    n_rows,
    BLOCK_R: tl.constexpr,  # rows per tile
    BLOCK: tl.constexpr,  # columns per tile
    OAI: tl.constexpr,  # gpt-oss form: min(gate, limit) * sigmoid(alpha * .) * (clamp(up) + 1)
    LAUNCH_DEPENDENTS: tl.constexpr,  # launch.launches_dependents: a PDL dependent may start now
    WAIT: tl.constexpr,  # launched as a programmatic dependent: wait for the kernel before, first
):
    """Standard: out = a * sigmoid(a) * b.  OAI: a' = min(a, limit), b' = clamp(b, -limit, limit),
    out = a' * sigmoid(alpha a') * (b' + 1)."""
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    if WAIT:  # (before any load or store: the input, and this kernel's output, may be the kernel before's)
        tl.extra.cuda.gdc_wait()
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    a = tl.load(gate_ptr + rows * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_ptr + rows * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if OAI:
        a = tl.minimum(a, limit)
        b = tl.minimum(tl.maximum(b, -limit), limit)
        out = a * tl.sigmoid(alpha * a) * (b + 1.0)
    else:
        out = a * tl.sigmoid(a) * b
    tl.store(out_ptr + rows * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(
    grad_ptr,  # [rows, d] upstream gradient
    gate_ptr,  # [rows, d]
    up_ptr,  # [rows, d]
    dgate_ptr,  # [rows, d] out: d/dgate
    dup_ptr,  # [rows, d] out: d/dup
    grad_row_stride,
    gate_row_stride,
    up_row_stride,
    dgate_row_stride,
    dup_row_stride,
    n_cols,
    alpha,
    limit,
    n_rows,
    BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
    OAI: tl.constexpr,
):
    """Standard, s = sigmoid(a): da = g b s (1 + a (1 - s)), db = g a s.
    OAI, s = sigmoid(alpha a'): da = g (b' + 1) s (1 + alpha a' (1 - s)) [a <= limit],
    db = g a' s [|b| <= limit]."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    g = tl.load(grad_ptr + rows * grad_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(gate_ptr + rows * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up_ptr + rows * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if OAI:
        ac = tl.minimum(a, limit)
        bc = tl.minimum(tl.maximum(b, -limit), limit)
        s = tl.sigmoid(alpha * ac)
        da = tl.where(a <= limit, g * (bc + 1.0) * s * (1.0 + alpha * ac * (1.0 - s)), 0.0)
        db = tl.where((b >= -limit) & (b <= limit), g * ac * s, 0.0)
    else:
        s = tl.sigmoid(a)
        da = g * b * s * (1.0 + a * (1.0 - s))
        db = g * a * s
    tl.store(dgate_ptr + rows * dgate_row_stride + cols, da.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + rows * dup_row_stride + cols, db.to(dup_ptr.dtype.element_ty), mask=mask)


def _check_pair(gate: torch.Tensor, up: torch.Tensor, op: str) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"{op}: gate and up must match in shape, dtype and device, got {tuple(gate.shape)} {gate.dtype} "
            f"{gate.device} and {tuple(up.shape)} {up.dtype} {up.device}"
        )


def _tiles(rows: int, d: int, backward: bool = False) -> tuple[int, int, tuple[int, int], int]:
    """(rows a tile, columns a tile, grid, warps) for ``rows`` x ``d``."""
    big = min(BIG_BLOCK_BWD if backward else BIG_BLOCK, next_power_of_2(d))
    if isinstance(rows, int) and rows * cdiv(d, big) >= BIG_GRID:  # (a traced row count: the tiles below)
        return 1, big, (rows, cdiv(d, big)), BIG_WARPS
    block = min(BLOCK, next_power_of_2(d))
    rows_per_tile = block_rows(rows, block)
    return rows_per_tile, block, (cdiv(rows, rows_per_tile), cdiv(d, block)), 4


def warm_rows(d: int) -> tuple[int, ...]:
    """The fewest row counts whose forwards at width ``d`` launch every compiled kernel (launch key) that any
    row count launches: the first row count of each tiling (:func:`_tiles`) that is 1, a multiple of 16 or
    neither (what Triton specializes the row count on; the strides and ``d`` stay as the layer has them).
    From BIG_GRID rows on every row count takes the one-row tiles."""
    first: dict[tuple, int] = {}
    for rows in range(1, BIG_GRID + 17):
        r, block, _, warps = _tiles(rows, d)
        first.setdefault((r, block, warps, rows == 1, rows % 16 == 0), rows)
    return tuple(sorted(first.values()))


def _launch_fwd(
    gate2: torch.Tensor,
    up2: torch.Tensor,
    out2: torch.Tensor,
    alpha: float,
    limit: float,
    oai: bool,
    dependent: bool = False,
):
    """``dependent``: launched as a programmatic dependent of the kernel before (silu_and_mul_dependent)."""
    rows, d = out2.shape
    if rows == 0 or d == 0:
        return
    rows_per_tile, block, grid, warps = _tiles(rows, d)
    traceable(_swiglu_fwd)[grid](
        gate2, up2, out2, gate2.stride(0), up2.stride(0), out2.stride(0), d, alpha, limit, rows,
        BLOCK_R=rows_per_tile, BLOCK=block, OAI=oai, LAUNCH_DEPENDENTS=lets_dependents_start(out2),
        WAIT=dependent, num_warps=warps, **({"launch_pdl": True} if dependent else {}),
    )  # fmt: skip


def _launch_bwd(g2, gate2, up2, dgate2, dup2, alpha: float, limit: float, oai: bool) -> None:
    rows, d = g2.shape
    if rows == 0 or d == 0:
        return
    rows_per_tile, block, grid, warps = _tiles(rows, d, backward=True)
    traceable(_swiglu_bwd)[grid](
        g2, gate2, up2, dgate2, dup2,
        g2.stride(0), gate2.stride(0), up2.stride(0), dgate2.stride(0), dup2.stride(0),
        d, alpha, limit, rows, BLOCK_R=rows_per_tile, BLOCK=block, OAI=oai, num_warps=warps,
    )  # fmt: skip


# --- swiglu(gate, up) and swiglu_oai(x, y, alpha, limit) ------------------------------------------


def _pair_forward(
    gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float, oai: bool
) -> torch.Tensor:
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    _launch_fwd(
        rows_2d(gate), rows_2d(up), out.view(-1, out.shape[-1]) if out.dim() else out, alpha, limit, oai
    )
    return out


def _pair_backward(
    grad, gate, up, alpha: float, limit: float, oai: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    dgate = torch.empty_like(gate, memory_format=torch.contiguous_format)
    dup = torch.empty_like(up, memory_format=torch.contiguous_format)
    d = gate.shape[-1]
    _launch_bwd(
        rows_2d(grad), rows_2d(gate), rows_2d(up), dgate.view(-1, d), dup.view(-1, d), alpha, limit, oai
    )
    return dgate, dup


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check_pair(gate, up, "swiglu")
    if use_reference(gate):
        return reference.swiglu(gate, up)
    return _pair_forward(gate, up, 0.0, 0.0, False)


def _swiglu_backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_reference(gate):
        return reference.swiglu_backward(grad, gate, up)
    return _pair_backward(grad, gate, up, 0.0, 0.0, False)


def _swiglu_oai(x: torch.Tensor, y: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    _check_pair(x, y, "swiglu_oai")
    if use_reference(x):
        return reference.swiglu_oai(x, y, alpha, limit)
    return _pair_forward(x, y, alpha, limit, True)


def _swiglu_oai_backward(
    grad: torch.Tensor, x: torch.Tensor, y: torch.Tensor, alpha: float, limit: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_reference(x):
        return reference.swiglu_oai_backward(grad, x, y, alpha, limit)
    return _pair_backward(grad, x, y, alpha, limit, True)


swiglu = triton_op("squeezeserve::swiglu", _swiglu, mutates_args=())
swiglu_backward = triton_op("squeezeserve::swiglu_backward", _swiglu_backward, mutates_args=())
swiglu_oai = triton_op("squeezeserve::swiglu_oai", _swiglu_oai, mutates_args=())
swiglu_oai_backward = triton_op("squeezeserve::swiglu_oai_backward", _swiglu_oai_backward, mutates_args=())


# --- silu_and_mul(x): x = [gate | up] ------------------------------------------------------------


def _check_packed(x: torch.Tensor) -> int:
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last dim must be even ([..., 2d]), got shape {tuple(x.shape)}")
    return x.shape[-1] // 2


def _silu_and_mul(x: torch.Tensor, dependent: bool = False) -> torch.Tensor:
    d = _check_packed(x)
    if use_reference(x):
        return reference.silu_and_mul(x)
    x2 = rows_2d(x)
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    _launch_fwd(x2[:, :d], x2[:, d:], out.view(-1, d), 0.0, 0.0, False, dependent)
    return out


def _silu_and_mul_dependent(x: torch.Tensor) -> torch.Tensor:
    return _silu_and_mul(x, dependent=True)


def _silu_and_mul_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    d = _check_packed(x)
    if use_reference(x):
        return reference.silu_and_mul_backward(grad, x)
    x2 = rows_2d(x)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dx2 = dx.view(-1, 2 * d)
    _launch_bwd(rows_2d(grad), x2[:, :d], x2[:, d:], dx2[:, :d], dx2[:, d:], 0.0, 0.0, False)
    return dx


def _silu_and_mul_traced(x: torch.Tensor) -> torch.Tensor:
    return _silu_and_mul(x)


silu_and_mul = triton_op("squeezeserve::silu_and_mul", _silu_and_mul_traced, mutates_args=())
silu_and_mul_backward = triton_op(
    "squeezeserve::silu_and_mul_backward", _silu_and_mul_backward, mutates_args=()
)


# --- fake (meta) kernels and autograd -----------------------------------------------


@swiglu.register_fake
def _(gate, up):
    _check_pair(gate, up, "swiglu")
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@swiglu_backward.register_fake
def _(grad, gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format), torch.empty_like(
        up, memory_format=torch.contiguous_format
    )


@swiglu_oai.register_fake
def _(x, y, alpha, limit):
    _check_pair(x, y, "swiglu_oai")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@swiglu_oai_backward.register_fake
def _(grad, x, y, alpha, limit):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(
        y, memory_format=torch.contiguous_format
    )


@silu_and_mul.register_fake
def _(x):
    d = _check_packed(x)
    return x.new_empty((*x.shape[:-1], d))


@silu_and_mul_backward.register_fake
def _(grad, x):
    return x.new_empty(x.shape)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:2])
    ctx.extra = inputs[2:]


def _swiglu_grad(ctx, grad, backward=swiglu_backward):
    gate, up = ctx.saved_tensors
    return backward(grad, gate, up)


def _swiglu_oai_grad(ctx, grad, backward=swiglu_oai_backward):
    x, y = ctx.saved_tensors
    alpha, limit = ctx.extra
    d_x, d_y = backward(grad, x, y, alpha, limit)
    return d_x, d_y, None, None


def _silu_and_mul_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _silu_and_mul_grad(ctx, grad, backward=silu_and_mul_backward):
    (x,) = ctx.saved_tensors
    return (backward(grad, x),)


swiglu.register_autograd(_swiglu_grad, setup_context=_save_inputs)
swiglu_oai.register_autograd(_swiglu_oai_grad, setup_context=_save_inputs)
silu_and_mul.register_autograd(_silu_and_mul_grad, setup_context=_silu_and_mul_setup)

# The same bodies and formulas for eager calls, without the dispatcher (registry.EagerOp).
# Calls without gradients replay their recorded launches (replay.LaunchPlans).
swiglu_eager = EagerOp(
    _swiglu, _save_inputs, partial(_swiglu_grad, backward=_swiglu_backward), plans=LaunchPlans()
)
swiglu_oai_eager = EagerOp(
    _swiglu_oai, _save_inputs, partial(_swiglu_oai_grad, backward=_swiglu_oai_backward), plans=LaunchPlans()
)
silu_and_mul_eager = EagerOp(
    _silu_and_mul,
    _silu_and_mul_setup,
    partial(_silu_and_mul_grad, backward=_silu_and_mul_backward),
    plans=LaunchPlans(),
)
# vLLM's SwiGLU between gate_up and down, launched as a programmatic dependent of gate_up's GEMM while a CUDA
# graph captures (as rmsnorm.rmsnorm_dependent; serving only).
silu_and_mul_dependent = EagerOp(
    _silu_and_mul_dependent,
    _silu_and_mul_setup,
    partial(_silu_and_mul_grad, backward=_silu_and_mul_backward),
    plans=LaunchPlans(),
)
