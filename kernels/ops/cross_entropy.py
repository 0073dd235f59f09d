"""Cross-entropy in the Liger style: loss and gradient in one kernel, the gradient written over the logits.

``cross_entropy_`` (the registered, mutating op) takes [N, V] logits and targets [N]; each program owns a
row, streams it once with an online softmax (running max m, running sum d, and the row sum for label
smoothing), then streams it again writing d(loss)/d(logits) into the logits buffer. The autograd wrapper
(:func:`cross_entropy`, behind ``functional.cross_entropy``) saves that buffer and only scales it in the
backward, so peak memory stays about one logits tensor. The caller's logits are overwritten when a
gradient is computed.

Math, eps = label_smoothing, V = vocab, t = target, lse = m + log d:
    loss = lse - (1 - eps) z_t - eps / V * sum_j z_j
    grad_j = softmax_j - (1 - eps) [j == t] - eps / V
Ignored rows (t == ignore_index) get loss 0 and gradient 0; 'mean' divides both by the count of
non-ignored rows, read from a device tensor (no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from squeezeserve.kernels import reference
from squeezeserve.kernels.ops.launch import next_power_of_2, traceable
from squeezeserve.kernels.registry import use_reference

# Columns per block of the online loop: large enough to keep loads wide, small enough not to spill.
MAX_BLOCK = 32768


@triton.jit
def _cross_entropy_fwd(
    logits_ptr,  # [N, V] logits in; d(loss)/d(logits) out when WRITE_GRAD
    logits_row_stride,
    target_ptr,  # [N] int targets
    loss_ptr,  # [N] fp32 out: per-row loss (already divided by n_valid for 'mean')
    n_valid_ptr,  # [] count of non-ignored rows (read only when MEAN)
    n_cols,  # V
    ignore_index,
    label_smoothing,
    BLOCK: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    MEAN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    target = tl.load(target_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if target == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if WRITE_GRAD:
            for start in range(0, n_cols, BLOCK):
                mask = start + cols < n_cols
                tl.store(row_ptr + start + cols, tl.zeros([BLOCK], dtype=tl.float32), mask=mask)
    else:
        scale = 1.0
        if MEAN:
            scale = 1.0 / tl.load(n_valid_ptr).to(tl.float32)
        m = -float("inf")
        d = 0.0
        row_sum = 0.0
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            z = tl.load(row_ptr + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            row_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
            m = m_new
        lse = m + tl.log(d)
        z_target = tl.load(row_ptr + target).to(tl.float32)
        smooth = label_smoothing / n_cols
        loss = lse - (1.0 - label_smoothing) * z_target - smooth * row_sum
        tl.store(loss_ptr + row, loss * scale)
        if WRITE_GRAD:
            for start in range(0, n_cols, BLOCK):
                mask = start + cols < n_cols
                z = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
                grad = tl.exp(z - lse) - smooth - tl.where(start + cols == target, 1.0 - label_smoothing, 0.0)
                tl.store(row_ptr + start + cols, (grad * scale).to(logits_ptr.dtype.element_ty), mask=mask)


def check_inputs(logits: torch.Tensor, target: torch.Tensor, reduction: str) -> None:
    reference.check_reduction(reduction)
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"cross_entropy expects logits [N, V] and target [N], got {tuple(logits.shape)} and "
            f"{tuple(target.shape)}"
        )
    if target.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cross_entropy: target must be int32 or int64, got {target.dtype}")


def launch_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    n_valid: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    write_grad: bool,
) -> torch.Tensor:
    """Per-row losses [N] fp32; writes the gradient over ``logits`` when ``write_grad``.

    ``n_valid`` is the batch-wide count of non-ignored rows ('mean'), so chunks of a batch (the fused
    linear cross-entropy) scale like the whole batch. On CPU tensors outside ``triton_on_cpu`` this runs
    the reference.
    """
    if logits.stride(-1) != 1:
        raise ValueError("cross_entropy: logits must have a unit stride along the vocabulary dim")
    if use_reference(logits):
        loss, grad = reference.cross_entropy_loss_and_grad(
            logits, target, ignore_index, label_smoothing, reduction, n_valid
        )
        if write_grad:
            logits.copy_(grad)
        return loss
    n_rows, n_cols = logits.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    block = min(next_power_of_2(n_cols), MAX_BLOCK)
    if n_rows:
        traceable(_cross_entropy_fwd)[(n_rows,)](
            logits, logits.stride(0), target, loss, n_valid, n_cols, ignore_index, label_smoothing,
            BLOCK=block, WRITE_GRAD=write_grad, MEAN=reduction == "mean",
            num_warps=16 if block >= 8192 else 8,
        )  # fmt: skip
    return loss


def _cross_entropy_(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    write_grad: bool,
) -> torch.Tensor:
    check_inputs(logits, target, reduction)
    n_valid = (target != ignore_index).sum()
    loss = launch_cross_entropy(logits, target, n_valid, ignore_index, label_smoothing, reduction, write_grad)
    return loss if reduction == "none" else loss.sum()


cross_entropy_ = triton_op("squeezeserve::cross_entropy_", _cross_entropy_, mutates_args={"logits"})


@cross_entropy_.register_fake
def _(logits, target, ignore_index, label_smoothing, reduction, write_grad):
    check_inputs(logits, target, reduction)
    shape = (logits.shape[0],) if reduction == "none" else ()
    return logits.new_empty(shape, dtype=torch.float32)


class _CrossEntropy(torch.autograd.Function):
    """Loss forward; the gradient, already written over the logits by the forward, scaled in the backward."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, reduction):
        # The kernel writes d(loss)/d(logits) over the logits buffer: no second [N, V] tensor.
        loss = cross_entropy_(logits, target, ignore_index, label_smoothing, reduction, True)
        # Saved detached: the gradient returned in the backward must not be the leaf itself, or autograd
        # copies it when accumulating (a second [N, V] tensor).
        ctx.save_for_backward(logits.detach())
        ctx.reduction = reduction
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad_logits,) = ctx.saved_tensors
        if ctx.reduction == "none":
            grad_logits.mul_(grad_loss[:, None].to(grad_logits.dtype))
        elif not bool(grad_loss == 1):
            # loss.backward() passes 1: skip a full read-and-write pass over [N, V] then (as Liger does, at
            # the price of one host sync).
            grad_logits.mul_(grad_loss.to(grad_logits.dtype))
        return grad_logits, None, None, None, None


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float, reduction: str
) -> torch.Tensor:
    """The autograd-aware entry: the gradient is computed in the forward only when logits require it."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _CrossEntropy.apply(logits, target, ignore_index, label_smoothing, reduction)
    return cross_entropy_(logits.clone(), target, ignore_index, label_smoothing, reduction, False)
