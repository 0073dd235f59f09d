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
  (tests/benchmarks/NOTES.md). Eager calls keep the partials and state words in a long-lived per-device
  workspace that the row's last program out zeroes again (:func:`_leave_row`), so a launch plan replays
  them with no fill; calls torch may be tracing make theirs per call.
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
    Workspace,
    block_rows,
    cdiv,
    next_power_of_2,
    num_warps_for,
    rows_2d,
    traceable,
)
from squeezeserve.kernels.ops.replay import LaunchPlans
from squeezeserve.kernels.registry import EagerOp, eager, interpreting, use_reference

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
def _leave_row(state_ptr, partials_ptr, n_partials, n_chunks, MAX_PARTIALS: tl.constexpr):
    """Count this program out of its row (``state_ptr[1]``, the done count); the row's last program out
    zeroes the row's state word, done count and ``n_partials`` partials, so the scratch is zero again for
    the next launch (the long-lived workspace: :func:`_workspace`).

    Called once a program reads neither the state word nor the partials again. Not the last arrival's job:
    when it arrives, the row's other programs may still be polling the state word or about to
    compare-and-swap their bit into it (:func:`_join_row`); zeroed under them, a poller would see too few
    arrivals, swap its bit into the zero word and leave its chunk unwritten (and the word dirty). So every
    program counts itself out after its last access to the state word (``_join_row``'s final atomic) and
    its last load of the partials (the last arrival's loop over the left chunks then reads only x / dy, y
    and m, d / dot from registers, so it counts itself out before that loop). The barrier orders every
    thread's loads before the count, which one thread makes; the count releases them; the counts form one
    release sequence, so the program whose count completes the row acquires every other program's: all
    their state atomics and their partial stores and loads happen before its zeroing stores, and nothing of
    this launch touches the row's words after. The next launch on the stream starts after this one ends.
    Under the interpreter (one program at a time) the row's last arrival is also its last program out.
    """
    tl.debug_barrier()  # every thread's loads of the partials happen before the (releasing) count below
    if tl.atomic_add(state_ptr + 1, 1, sem="acq_rel") == n_chunks - 1:
        tl.debug_barrier()
        tl.store(state_ptr, 0)
        tl.store(state_ptr + 1, 0)
        parts = tl.arange(0, MAX_PARTIALS)
        tl.store(partials_ptr + parts, tl.zeros([MAX_PARTIALS], tl.float32), mask=parts < n_partials)


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
    stats_ptr,  # [rows, n_chunks, 2] fp32 scratch, left zero: each chunk's (m_c, d_c)
    state_ptr,  # [rows, 2] int32, zero and left zero: each row's state word (_join_row) and done count
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
    write_own, last, left = _join_row(state_ptr + row * 2, chunk, n_chunks, SPINS)
    parts = tl.arange(0, MAX_CHUNKS)
    row_stats = stats_ptr + (row * n_chunks + parts) * 2
    mine = parts < n_chunks * write_own  # (a program that left reads none)
    # .cg: read the siblings' statistics from L2 (L1 is not coherent across SMs). Read before counting out:
    # the row's last program out zeroes them.
    m_all = tl.load(row_stats, mask=mine, other=-float("inf"), cache_modifier=".cg")
    d_all = tl.load(row_stats + 1, mask=mine, other=0.0, cache_modifier=".cg")
    _leave_row(state_ptr + row * 2, stats_ptr + row * n_chunks * 2, n_chunks * 2, n_chunks, MAX_CHUNKS * 2)
    if write_own:
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
    partial_ptr,  # [rows, n_chunks] fp32 scratch, left zero: each chunk's sum(dy y)
    state_ptr,  # [rows, 2] int32, zero and left zero: each row's state word (_join_row) and done count
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
    write_own, last, left = _join_row(state_ptr + row * 2, chunk, n_chunks, SPINS)
    parts = tl.arange(0, MAX_CHUNKS)
    mine = parts < n_chunks * write_own
    p_all = tl.load(partial_ptr + row * n_chunks + parts, mask=mine, other=0.0, cache_modifier=".cg")
    _leave_row(state_ptr + row * 2, partial_ptr + row * n_chunks, n_chunks, n_chunks, MAX_CHUNKS)
    if write_own:
        dot = tl.sum(p_all, axis=0)
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


# The device's split-path scratch: fp32 partials, int32 row states [rows, 2]; every split kernel zeroes what
# it used (:func:`_leave_row`), so eager calls need no fill and a launch plan can replay them.
_workspace = Workspace((torch.float32, 1 << 16), (torch.int32, 1 << 13))
workspace_buffers = _workspace.buffers


def _split_scratch(inputs: tuple[torch.Tensor, ...], rows: int, n_chunks: int, per_chunk: int):
    """(fp32 partials [rows, n_chunks, per_chunk], zero int32 row states [rows, 2]) for a split launch over
    ``inputs``: the long-lived workspace on eager calls, else (torch may be tracing the launch, and the
    workspace is state outside the op's inputs) made for the call."""
    n_partials, device = rows * n_chunks * per_chunk, inputs[0].device
    if eager(*inputs):
        return _workspace(device, n_partials, rows * 2)
    partials = torch.empty(n_partials, dtype=torch.float32, device=device)
    return partials, torch.zeros(rows * 2, dtype=torch.int32, device=device)


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
        n_chunks = cdiv(n, SPLIT_CHUNK)
        partials, state = _split_scratch(inputs, rows, n_chunks, per_chunk)
        traceable(split_kernel)[(rows * n_chunks,)](
            *inputs, out, partials, state, *strides, n, n_chunks,
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
# gradients replay their recorded launches (replay.LaunchPlans), split rows included: their scratch is the
# long-lived workspace, which a plan holds as a constant.
softmax_eager = EagerOp(
    _softmax,
    _setup,
    partial(_grad, backward=_softmax_backward),
    plans=LaunchPlans(persistent=workspace_buffers),
)
