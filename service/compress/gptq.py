"""GPTQ (Frantar et al., 2022): quantize a weight column by column, correcting the columns not yet
quantized for each column's rounding error, weighted by the inverse Hessian of the layer's inputs.

For a Linear with inputs ``X`` (one row per token), the loss ``||X W^T - X Q^T||^2`` has Hessian
``H = 2 X^T X`` (the scale does not matter here). With ``U`` the upper Cholesky factor of ``H^-1``
(damped: ``H + λ mean(diag H) I``), quantizing column ``j`` to ``q_j`` and applying

    e_j = (w_j - q_j) / U[j, j]          W[:, j+1:] -= e_j ⊗ U[j, j+1:]

is the optimal update of the remaining columns. The updates are applied lazily, as in the reference
implementation: within a run of ``SWEEP`` columns one rank-1 update per column touches only that run;
the run's errors ``E`` then reach the rest of its block in one matmul (``U[run, rest]^T E``), and each
block's errors reach the rest of the matrix in one more. Work is done on ``W^T``, so a column is a
contiguous row. Group scales and zero points are fixed up front from the weight as given under ``actorder``
(columns swept by decreasing ``H[j, j]``, groups still the natural runs of columns) and otherwise taken
from the *updated* weights when the sweep reaches a group; either by min/max (as in RTN) or by
``search_qparams`` weighted by ``diag(H)``. With a pruning ``mask`` the pruned entries are forced to 0
(exactly representable) and their error is spread like any other rounding error (SparseGPT's compensation,
mask fixed in advance); kept entries never round to 0, so the sparsity pattern survives quantization
exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from squeezeserve.service.compress.quantize import (
    QuantizedWeight,
    QuantScheme,
    compute_qparams,
    dequantize_codes,
    package,
    quantize_with,
    search_qparams,
)

# Columns quantized one at a time between two matmul updates: short runs keep each rank-1 update small.
SWEEP = 32


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch ops on one thread. The column sweep is thousands of ops on vectors of ``out`` floats:
    splitting those across threads only adds a barrier per op, and on a busy machine each barrier can wait
    for a descheduled thread. On a shared machine under load the sweep ran many times slower on 2 threads
    than on 1, and the block matmuls and the factorisation are too small to gain from a second thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def keep_nonzero(
    codes: torch.Tensor,
    weight: torch.Tensor,
    zero: torch.Tensor | None,
    keep: torch.Tensor,
    scheme: QuantScheme,
) -> torch.Tensor:
    """Move kept entries whose code decodes to 0 one step towards their weight's sign (the other way when
    that step leaves [qmin, qmax]: a zero point at qmax has no code above it)."""
    zero_code = torch.zeros_like(codes) if zero is None else zero.expand_as(codes)
    collapsed = keep & (codes == zero_code)
    step = torch.where(weight >= 0, 1.0, -1.0)
    step = torch.where(zero_code + step > scheme.qmax, -1.0, step)
    step = torch.where(zero_code + step < scheme.qmin, 1.0, step)
    return torch.where(collapsed, zero_code + step, codes)


def apply_mask(
    codes: torch.Tensor,
    weight: torch.Tensor,
    zero: torch.Tensor | None,
    mask: torch.Tensor | None,
    scheme: QuantScheme,
) -> torch.Tensor:
    """Pruned entries (``mask`` False) get the code of 0; kept entries a nonzero code (int schemes)."""
    if mask is None:
        return codes
    zero_code = torch.zeros_like(codes) if zero is None else zero.expand_as(codes)
    codes = torch.where(mask, codes, zero_code)
    return keep_nonzero(codes.clamp(scheme.qmin, scheme.qmax), weight, zero, mask, scheme)


def inverse_hessian_factor(gram: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``U`` (upper Cholesky factor of the damped ``H^-1``) and the mask of dead inputs (never nonzero)."""
    h = gram.to(torch.float32).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(h.shape[0], device=h.device)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True), dead


def gptq_quantize(
    weight: torch.Tensor,
    gram: torch.Tensor,
    scheme: QuantScheme,
    mask: torch.Tensor | None = None,
    damp: float = 0.01,
    block_size: int = 128,
    actorder: bool = False,
    search: bool = False,
) -> QuantizedWeight:
    """GPTQ-quantize ``weight`` ``[out, in]`` given its inputs' Gram matrix ``gram`` ``[in, in]``.

    ``actorder``: sweep the columns in order of decreasing ``H[j, j]`` (compressed-tensors'
    ``actorder: weight``: groups stay the natural runs of ``group_size`` columns, so the checkpoint format is
    unchanged, and their parameters are fixed up front from the weight before any update). ``search``:
    group parameters from ``search_qparams`` weighted by ``H``'s diagonal instead of min/max."""
    if scheme.kind != "int":
        raise ValueError("GPTQ applies to integer schemes only")
    in_features = weight.shape[1]
    if gram.shape != (in_features, in_features):
        raise ValueError(f"gram must be [{in_features}, {in_features}], got {tuple(gram.shape)}")
    with one_thread():
        return _gptq(weight, gram.to(weight.device), scheme, mask, damp, block_size, actorder, search)


def group_qparams(
    columns: torch.Tensor, scheme: QuantScheme, importance: torch.Tensor | None, search: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Parameters ``[groups, out]`` of ``columns`` ``[groups * width, out]`` (rows are input columns)."""
    width = columns.shape[0] if scheme.group_size is None else scheme.group_size
    grouped = columns.t().reshape(columns.shape[1], -1, width)  # [out, groups, width]
    if search:
        scale, zero = search_qparams(
            grouped, scheme, None if importance is None else importance.view(-1, width)
        )
    else:
        scale, zero = compute_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), scheme)
    return scale.t(), None if zero is None else zero.t()


def sweep(
    wt: torch.Tensor,
    u: torch.Tensor,
    quantize_column: Callable[[int, torch.Tensor], torch.Tensor],
    block_size: int,
    run: int,
    run_start: Callable[[int], None] | None = None,
) -> None:
    """GPTQ's column sweep over ``wt`` [in, out] (updated in place), ``u`` the upper Cholesky factor of the
    damped ``H^-1`` in the same column order. ``quantize_column(j, column)`` rounds column j (a row of
    ``wt``: every output's weight on input j) and returns its dequantized value; its error, divided by
    ``U[j, j]``, is spread over the columns not yet quantized (the module docstring's lazy updates: runs of
    ``run`` columns inside blocks of ``block_size``). ``run_start(j)`` is called before each run, when every
    earlier column's error has reached columns ``j..j + run``."""
    in_features = wt.shape[0]
    for b0 in range(0, in_features, block_size):
        b1 = min(b0 + block_size, in_features)
        block = wt[b0:b1]  # a view: updates land in wt
        errors = torch.empty_like(block)
        for r0 in range(0, b1 - b0, run):
            r1 = min(r0 + run, b1 - b0)
            first = b0 + r0
            if run_start is not None:
                run_start(first)
            u_run = u[first : b0 + r1, first : b0 + r1]
            for i in range(r1 - r0):
                column = block[r0 + i]
                error = (column - quantize_column(first + i, column)) / u_run[i, i]
                errors[r0 + i] = error
                block[r0 + i + 1 : r1].addr_(u_run[i, i + 1 :], error, alpha=-1.0)
            block[r1:].addmm_(u[first : b0 + r1, b0 + r1 : b1].t(), errors[r0:r1], alpha=-1.0)
        wt[b1:].addmm_(u[b0:b1, b1:].t(), errors, alpha=-1.0)


def _gptq(
    weight: torch.Tensor,
    gram: torch.Tensor,
    scheme: QuantScheme,
    mask: torch.Tensor | None,
    damp: float,
    block_size: int,
    actorder: bool,
    search: bool,
) -> QuantizedWeight:
    out, in_features = weight.shape
    device = weight.device
    wt = weight.detach().to(torch.float32).t().contiguous()  # [in, out]: column j of W is row j
    wt[torch.diag(gram) == 0] = 0.0
    keep = None if mask is None else mask.t()
    width = scheme.group_width(in_features)
    importance = torch.diag(gram).to(torch.float32)
    # Static parameters (per channel, or every group under actorder) come from the weight as given;
    # otherwise each group's come from the updated weight when the sweep reaches it.
    static = actorder or scheme.group_size is None
    scales = torch.empty(scheme.groups_for(in_features), out, device=device)
    zeros = None if scheme.symmetric else torch.empty_like(scales)
    if static:
        scales, zeros = group_qparams(wt, scheme, importance, search)
    order = torch.arange(in_features, device=device)
    if actorder:
        order = torch.argsort(importance, descending=True, stable=True)
        wt, gram = wt[order], gram[order][:, order]
        keep = None if keep is None else keep[order]
    group_of = (order // width).tolist()
    u, _ = inverse_hessian_factor(gram, damp)

    run = math.gcd(width, SWEEP)  # a run never straddles a group start
    block_size = max(width, block_size // width * width) if scheme.group_size is not None else block_size
    block_size = max(run, block_size // run * run)
    codes = torch.empty(in_features, out, device=device)

    def group_start(first: int) -> None:
        if first % width == 0:
            # Every earlier column's error has reached this group by now: its range is final.
            g = first // width
            group = slice(first, first + width)
            scale, zero = group_qparams(wt[group], scheme, importance[group], search)
            scales[g] = scale[0]
            if zeros is not None and zero is not None:
                zeros[g] = zero[0]

    def quantize_column(j: int, column: torch.Tensor) -> torch.Tensor:
        g = group_of[j]
        s, z = scales[g], None if zeros is None else zeros[g]
        q = quantize_with(column, s, z, scheme)
        if keep is not None:
            q = apply_mask(q, column, z, keep[j], scheme)
        codes[j] = q
        return dequantize_codes(q, s, z)

    sweep(wt, u, quantize_column, block_size, run, None if static else group_start)
    if actorder:
        codes = torch.empty_like(codes).index_copy_(0, order, codes)
    return package(codes.t(), scales.t(), None if zeros is None else zeros.t(), scheme)
