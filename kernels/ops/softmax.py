"""Softmax over the last dim, forward and backward.

Rows up to ``SINGLE_BLOCK_COLS`` (65536, Liger's limit) sit in one block, several narrow rows per
program: one read, one write. Wider rows (a 128k vocabulary; no limit on the width) take one of two
paths:

- split, up to ``MAX_SPLIT_CHUNKS`` chunks: the row is cut into ``SPLIT_CHUNK``-column chunks, one program
  each, the chunk held in registers. Every program reduces its chunk to partial statistics (forward: m_c =
  max x, d_c = sum exp(x - m_c); backward: sum dy y), stores them and counts itself in with an atomic, then
  polls until the row's other chunks are in, merges the partials (m = max m_c, d = sum d_c exp(m_c - m)) and
  writes its own chunk: one read and one write of every element, the floor. A program that has polled
  ``WAIT_POLLS`` times without seeing its row complete leaves instead, flagging its chunk in the row's state
  word by compare-and-swap, and the row's last arrival writes the flagged chunks, re-reading them
  (:func:`_join_row`): no program waits unboundedly, and under the interpreter, which runs programs one at a
  time, every program but the last leaves. Waiting measured as fast as leaving at once, and its bytes do not
  depend on the left chunk still being in L2; the split path beat the online one at every width measured
  (tests/benchmarks/NOTES.md).
- online, for wider rows: one program per row streams it once keeping a running max m and a running sum
  d = sum exp(x - m) (rescaled by exp(m_old - m_new) when the max grows), then reads it again and writes
  exp(x - m) / d: three passes over the row.
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
    next_power_of_2,
    num_warps_for,
    rows_2d,
    traceable,
)
from squeezeserve.kernels.ops.replay import LaunchPlans
from squeezeserve.kernels.registry import EagerOp, interpreting, use_reference

SINGLE_BLOCK_COLS = 65536
ONLINE_BLOCK = 8192
SPLIT_CHUNK = 8192
SPLIT_WARPS = 8  # from the H100 sweep of chunk width x warps (tests/benchmarks/NOTES.md)
MAX_SPLIT_CHUNKS = 24  # chunk bits 8..31 of the row's int32 state word (196608 columns)
WAIT_POLLS = 1 << 16  # polls before a chunk leaves its output to the row's last arrival


@triton.jit
def _write_softmax_row(x_row, y_row, m, d, n_cols, BLOCK: tl.constexpr):
    """y = exp(x - m) / d over one row, given its max m and sum d = sum exp(x - m)."""
    cols = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        tl.store(y_row + start + cols, (tl.exp(x - m) / d).to(y_row.dtype.element_ty), mask=mask)


@triton.jit
def _write_grad_row(dy_row, y_row, dx_row, dot, n_cols, BLOCK: tl.constexpr):
    """dx = y (dy - dot) over one row, given dot = sum(dy y)."""
    cols = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        dy = tl.load(dy_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_row + start + cols, (y * (dy - dot)).to(dx_row.dtype.element_ty), mask=mask)


@triton.jit
def _join_row(state_ptr, chunk, n_chunks, SPINS: tl.constexpr):
    """Count this chunk's statistics in and wait (at most SPINS polls) until the row's others are in.

    ``state`` packs the row's arrivals (bits 0-7) and one bit per chunk whose program left without
    writing its output (bit 8 + chunk). Returns (write_own, last, abandoned): write_own when every
    chunk's statistics are in; the last arrival also gets the left chunks' bits to write for them. A
    program leaves only through a compare-and-swap on a still-incomplete state, so a bit is either seen by
    the last arrival or never set -- no chunk is left unwritten, and no program waits unboundedly (the
    interpreter runs programs one by one: there every program but the last leaves).
    """
    old = tl.atomic_add(state_ptr, 1, sem="acq_rel")
    last = (old & 0xFF) == n_chunks - 1
    seen = old + 1
    spins = 0
    while ((seen & 0xFF) < n_chunks) & (spins < SPINS):
        seen = tl.atomic_add(state_ptr, 0, sem="acquire")
        spins += 1
    left = 0
    while ((seen & 0xFF) < n_chunks) & (left == 0):
        prev = tl.atomic_cas(state_ptr, seen, seen | (1 << (8 + chunk)), sem="acq_rel")
        left = (prev == seen).to(tl.int32)
        seen = prev
    return left == 0, last, old >> 8


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
        # One program per row (a persistent one-program-per-SM loop measured slower).
        for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
            x_row = x_ptr + row * x_row_stride
            y_row = y_ptr + row * y_row_stride
            m = -float("inf")
            d = 0.0
            for start in range(0, n_cols, BLOCK):
                mask = start + cols < n_cols
                x = tl.load(x_row + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
                m_new = tl.maximum(m, tl.max(x, axis=0))
                # Shift by 0 while every value so far is -inf (masked), avoiding -inf - -inf.
                shift = tl.where(m_new == -float("inf"), 0.0, m_new)
                d = d * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
                m = m_new
            _write_softmax_row(x_row, y_row, m, d, n_cols, BLOCK)


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
            _write_grad_row(
                dy_ptr + row * dy_row_stride, y_ptr + row * y_row_stride, dx_ptr + row * dx_row_stride,
                dot, n_cols, BLOCK,
            )  # fmt: skip


@triton.jit
def _softmax_fwd_split(
    x_ptr,  # [rows, n] input
    y_ptr,  # [rows, n] out: softmax(x)
    stats_ptr,  # [rows, n_chunks, 2] fp32 scratch: each chunk's (m_c, d_c)
    state_ptr,  # [rows] int32, zeroed: arrivals and left chunks of each row (_join_row)
    x_row_stride,
    y_row_stride,
    n_cols,
    n_chunks,
    CHUNK: tl.constexpr,  # columns per program
    MAX_CHUNKS: tl.constexpr,  # next power of two >= n_chunks
    SPINS: tl.constexpr,  # polls before a chunk leaves its output to the row's last arrival
):
    """m_c = max x[chunk], d_c = sum exp(x[chunk] - m_c); once every chunk's statistics are in,
    m = max_c m_c, d = sum_c d_c exp(m_c - m) and the chunk writes exp(x - m) / d from its registers (the
    row's last arrival also writes the chunks whose programs left, see :func:`_join_row`)."""
    pid = tl.program_id(0)
    row = (pid // n_chunks).to(tl.int64)
    chunk = pid % n_chunks
    cols = tl.arange(0, CHUNK)
    x_row = x_ptr + row * x_row_stride
    mask = chunk * CHUNK + cols < n_cols
    x = tl.load(x_row + chunk * CHUNK + cols, mask=mask, other=-float("inf")).to(tl.float32)
    m_c = tl.max(x, axis=0)
    # A chunk of -inf (masked columns) has d_c = 0; shifting by 0 instead of m_c avoids -inf - -inf.
    shift = tl.where(m_c == -float("inf"), 0.0, m_c)
    e = tl.exp(x - shift)  # kept: the output is e exp(shift - m) / d, one exponential per element
    d_c = tl.sum(e, axis=0)
    stats = stats_ptr + (row * n_chunks + chunk) * 2
    tl.store(stats, m_c)
    tl.store(stats + 1, d_c)
    tl.debug_barrier()  # every thread's stores happen before the (releasing) count below
    write_own, last, left = _join_row(state_ptr + row, chunk, n_chunks, SPINS)
    if write_own:
        parts = tl.arange(0, MAX_CHUNKS)
        row_stats = stats_ptr + (row * n_chunks + parts) * 2
        # .cg: read the siblings' statistics from L2 (L1 is not coherent across SMs).
        m_all = tl.load(row_stats, mask=parts < n_chunks, other=-float("inf"), cache_modifier=".cg")
        d_all = tl.load(row_stats + 1, mask=parts < n_chunks, other=0.0, cache_modifier=".cg")
        m = tl.max(m_all, axis=0)
        d = tl.sum(d_all * tl.exp(m_all - m), axis=0)
        y_row = y_ptr + row * y_row_stride
        scale = tl.exp(shift - m) / d
        tl.store(y_row + chunk * CHUNK + cols, (e * scale).to(y_row.dtype.element_ty), mask=mask)
        if last:
            for c in range(0, n_chunks):
                if ((left >> c) & 1) != 0:
                    _write_softmax_row(x_row + c * CHUNK, y_row + c * CHUNK, m, d,
                                       tl.minimum(n_cols - c * CHUNK, CHUNK), CHUNK)  # fmt: skip


@triton.jit
def _softmax_bwd_split(
    dy_ptr,  # [rows, n] upstream gradient
    y_ptr,  # [rows, n] softmax output
    dx_ptr,  # [rows, n] out
    partial_ptr,  # [rows, n_chunks] fp32 scratch: each chunk's sum(dy y)
    state_ptr,  # [rows] int32, zeroed (_join_row)
    dy_row_stride,
    y_row_stride,
    dx_row_stride,
    n_cols,
    n_chunks,
    CHUNK: tl.constexpr,
    MAX_CHUNKS: tl.constexpr,
    SPINS: tl.constexpr,
):
    """p_c = sum dy[chunk] y[chunk]; once every chunk's p_c is in, the chunk writes y (dy - sum_c p_c) from
    its registers (the row's last arrival also writes the chunks whose programs left)."""
    pid = tl.program_id(0)
    row = (pid // n_chunks).to(tl.int64)
    chunk = pid % n_chunks
    cols = tl.arange(0, CHUNK)
    dy_row = dy_ptr + row * dy_row_stride
    y_row = y_ptr + row * y_row_stride
    mask = chunk * CHUNK + cols < n_cols
    dy = tl.load(dy_row + chunk * CHUNK + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_row + chunk * CHUNK + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(partial_ptr + row * n_chunks + chunk, tl.sum(dy * y, axis=0))
    tl.debug_barrier()
    write_own, last, left = _join_row(state_ptr + row, chunk, n_chunks, SPINS)
    if write_own:
        parts = tl.arange(0, MAX_CHUNKS)
        dot = tl.sum(
            tl.load(
                partial_ptr + row * n_chunks + parts, mask=parts < n_chunks, other=0.0, cache_modifier=".cg"
            ),
            axis=0,
        )
        dx_row = dx_ptr + row * dx_row_stride
        tl.store(dx_row + chunk * CHUNK + cols, (y * (dy - dot)).to(dx_row.dtype.element_ty), mask=mask)
        if last:
            for c in range(0, n_chunks):
                if ((left >> c) & 1) != 0:
                    _write_grad_row(dy_row + c * CHUNK, y_row + c * CHUNK, dx_row + c * CHUNK, dot,
                                    tl.minimum(n_cols - c * CHUNK, CHUNK), CHUNK)  # fmt: skip


def _split(n_cols: int) -> bool:
    """The split path serves rows of up to MAX_SPLIT_CHUNKS chunks (the state word's bits); wider rows take
    the online path."""
    return cdiv(n_cols, SPLIT_CHUNK) <= MAX_SPLIT_CHUNKS


def _spins() -> int:
    """Polls a chunk makes before leaving its output to the row's last arrival: the interpreter runs
    programs one at a time (waiting is pointless), on a GPU the row's programs run together."""
    return 1 if interpreting() else WAIT_POLLS


def launch_config(n_cols: int) -> tuple[int, bool, int]:
    """(block, single, num_warps) for rows of ``n_cols``: one block when it fits, else the online path."""
    if n_cols < 1:
        raise ValueError(f"softmax: the last dimension must be at least 1, got {n_cols}")
    single = n_cols <= SINGLE_BLOCK_COLS
    block = next_power_of_2(n_cols) if single else ONLINE_BLOCK
    return block, single, num_warps_for(block)


def _split_scratch(rows: int, n_cols: int, per_chunk: int, device: torch.device):
    """(n_chunks, fp32 partials [rows, n_chunks, per_chunk], zeroed int32 arrival counts [rows])."""
    n_chunks = cdiv(n_cols, SPLIT_CHUNK)
    partials = torch.empty((rows, n_chunks, per_chunk), dtype=torch.float32, device=device)
    return n_chunks, partials, torch.zeros(rows, dtype=torch.int32, device=device)


def _launch(split_kernel, row_kernel, inputs: tuple[torch.Tensor, ...], out: torch.Tensor, per_chunk: int):
    """Launch the forward or backward over [rows, n] views: ``inputs`` then ``out`` (and their row strides)
    go to ``split_kernel`` for rows the split path serves, else to ``row_kernel``; ``per_chunk`` is the
    split path's fp32 partials per chunk (forward 2: m_c, d_c; backward 1: sum dy y)."""
    rows, n = out.shape
    block, single, warps = launch_config(n)
    if not rows:
        return
    strides = [t.stride(0) for t in (*inputs, out)]
    if not single and _split(n):
        n_chunks, partials, arrivals = _split_scratch(rows, n, per_chunk, out.device)
        traceable(split_kernel)[(rows * n_chunks,)](
            *inputs, out, partials, arrivals, *strides, n, n_chunks,
            CHUNK=SPLIT_CHUNK, MAX_CHUNKS=next_power_of_2(n_chunks), SPINS=_spins(), num_warps=SPLIT_WARPS,
        )  # fmt: skip
    else:
        block_r = block_rows(rows, block) if single else 1
        traceable(row_kernel)[(cdiv(rows, block_r),)](
            *inputs, out, *strides, n, rows, BLOCK_R=block_r, BLOCK=block, SINGLE=single, num_warps=warps
        )  # fmt: skip


def _softmax(x: torch.Tensor) -> torch.Tensor:
    if use_reference(x):
        return reference.softmax(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(_softmax_fwd_split, _softmax_fwd, (rows_2d(x),), y.view(-1, x.shape[-1]), per_chunk=2)
    return y


def _softmax_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if use_reference(y):
        return reference.softmax_backward(grad, y)
    dx = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    _launch(
        _softmax_bwd_split, _softmax_bwd, (rows_2d(grad), rows_2d(y)), dx.view(-1, y.shape[-1]), per_chunk=1
    )
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
# The same body and formula for eager calls, without the dispatcher (registry.EagerOp); calls without
# gradients replay their recorded launches (replay.LaunchPlans; rows wider than one block allocate scratch
# and run the body every call).
softmax_eager = EagerOp(_softmax, _setup, partial(_grad, backward=_softmax_backward), plans=LaunchPlans())
