"""Fused linear knowledge distillation: forward KL from a teacher's to a student's next-token distribution,
from both models' hidden states and LM heads, without materialising either [N, V] logits tensor.

The forward walks token chunks like the fused linear cross-entropy: per chunk one matmul per model gives
the chunk's student and teacher logits, the ``_kd_fwd`` kernel turns them into per-token losses and writes
d(loss)/d(student logits) over the student chunk, and that gradient goes straight into the student's
gradients (``grad_hidden[chunk] = G @ W_s``, ``grad_weight += G^T @ h_s[chunk]``); the backward only scales
them by the incoming scalar. Two chunks of logits are live at once, so a chunk holds half as many tokens as
the fused cross-entropy's (together about as many elements as the student's hidden states).

Math, per token, T = temperature, a = z_t / T, b = z_s / T, p = softmax(a), q = softmax(b), w = lm_weight:

    KL(p || q) = sum_j p_j (a_j - b_j) - lse(a) + lse(b)
    loss       = (1 - w) T^2 KL(p || q) + w (lse(z_s) - z_s[target])
    d loss / d z_s,j = (1 - w) T (q_j - p_j) + w (softmax(z_s)_j - [j == target])

(the T^2 factor keeps the gradient's size independent of T, Hinton et al. 2015). The kernel streams a row
twice: first an online softmax over a (running max m_a, sum d_a and ``acc = sum exp(a - m_a)(a - b)``,
rescaled like d_a whenever m_a grows), over b (m_b, d_b) and, for the LM term, over z_s (m_1, d_1); then
once more writing the gradient. Tokens whose target is ``ignore_index`` contribute nothing; 'mean' divides by
the count of the others (every token when no target is given). The teacher gets no gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from squeezeserve.kernels import reference
from squeezeserve.kernels.ops.fused_linear_ce import accumulate_weight_grad, chunk_tokens, unit_grad
from squeezeserve.kernels.ops.launch import next_power_of_2, traceable
from squeezeserve.kernels.registry import EagerOp, use_reference

# Columns per block of the online loops (the cross-entropy kernel's width: three running softmaxes here).
MAX_BLOCK = 16384


@triton.jit
def _kd_fwd(
    student_ptr,  # [N, V] student logits in; d(loss)/d(student logits) out when WRITE_GRAD
    student_row_stride,
    teacher_ptr,  # [N, V] teacher logits (read only)
    teacher_row_stride,
    target_ptr,  # [N] int targets (read only when HAS_TARGET)
    loss_ptr,  # [N] fp32 out: per-row loss (already divided by n_valid for 'mean')
    n_valid_ptr,  # [] count of non-ignored rows (read only when MEAN)
    n_cols,  # V
    ignore_index,
    inv_temperature,  # 1 / T
    kd_weight,  # (1 - w) T^2
    lm_weight,  # w
    BLOCK: tl.constexpr,
    HAS_TARGET: tl.constexpr,  # rows with target == ignore_index are skipped
    LM: tl.constexpr,  # add the LM term (w > 0)
    WRITE_GRAD: tl.constexpr,
    MEAN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row = student_ptr + row * student_row_stride
    t_row = teacher_ptr + row * teacher_row_stride
    cols = tl.arange(0, BLOCK)
    target = -1
    skip = False
    if HAS_TARGET:
        target = tl.load(target_ptr + row).to(tl.int64)
        skip = target == ignore_index
    if skip:
        tl.store(loss_ptr + row, 0.0)
        if WRITE_GRAD:
            for start in range(0, n_cols, BLOCK):
                mask = start + cols < n_cols
                tl.store(s_row + start + cols, tl.zeros([BLOCK], dtype=tl.float32), mask=mask)
    else:
        scale = 1.0
        if MEAN:
            scale = 1.0 / tl.load(n_valid_ptr).to(tl.float32)
        m_a = -float("inf")
        d_a = 0.0
        acc = 0.0
        m_b = -float("inf")
        d_b = 0.0
        m_1 = -float("inf")
        d_1 = 0.0
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            # Padding loads as 0 and is masked to -inf after the arithmetic (inf - inf would be NaN).
            z_s = tl.load(s_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            z_t = tl.load(t_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            a = tl.where(mask, z_t * inv_temperature, -float("inf"))
            b = tl.where(mask, z_s * inv_temperature, -float("inf"))
            m_a_new = tl.maximum(m_a, tl.max(a, axis=0))
            e_a = tl.exp(a - m_a_new)
            rescale = tl.exp(m_a - m_a_new)
            d_a = d_a * rescale + tl.sum(e_a, axis=0)
            acc = acc * rescale + tl.sum(e_a * (z_t - z_s) * inv_temperature, axis=0)
            m_a = m_a_new
            m_b_new = tl.maximum(m_b, tl.max(b, axis=0))
            d_b = d_b * tl.exp(m_b - m_b_new) + tl.sum(tl.exp(b - m_b_new), axis=0)
            m_b = m_b_new
            if LM:
                z_1 = tl.where(mask, z_s, -float("inf"))
                m_1_new = tl.maximum(m_1, tl.max(z_1, axis=0))
                d_1 = d_1 * tl.exp(m_1 - m_1_new) + tl.sum(tl.exp(z_1 - m_1_new), axis=0)
                m_1 = m_1_new
        lse_a = m_a + tl.log(d_a)
        lse_b = m_b + tl.log(d_b)
        loss = kd_weight * (acc / d_a - lse_a + lse_b)
        lse_1 = 0.0
        if LM:
            lse_1 = m_1 + tl.log(d_1)
            loss += lm_weight * (lse_1 - tl.load(s_row + target).to(tl.float32))
        tl.store(loss_ptr + row, loss * scale)
        if WRITE_GRAD:
            kd_grad = kd_weight * inv_temperature
            for start in range(0, n_cols, BLOCK):
                mask = start + cols < n_cols
                z_s = tl.load(s_row + start + cols, mask=mask, other=0.0).to(tl.float32)
                z_t = tl.load(t_row + start + cols, mask=mask, other=0.0).to(tl.float32)
                q = tl.exp(z_s * inv_temperature - lse_b)
                p = tl.exp(z_t * inv_temperature - lse_a)
                grad = kd_grad * (q - p)
                if LM:
                    grad += lm_weight * (tl.exp(z_s - lse_1) - tl.where(start + cols == target, 1.0, 0.0))
                tl.store(s_row + start + cols, (grad * scale).to(student_ptr.dtype.element_ty), mask=mask)


def launch_kd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor | None,
    n_valid: torch.Tensor,
    temperature: float,
    lm_weight: float,
    ignore_index: int,
    reduction: str,
    write_grad: bool,
) -> torch.Tensor:
    """Per-row losses [N] fp32; writes the gradient over ``student_logits`` when ``write_grad``.

    ``n_valid`` is the batch-wide count of scored rows ('mean'), so chunks scale like the whole batch. On CPU
    tensors outside ``triton_on_cpu`` this runs the reference.
    """
    if student_logits.stride(-1) != 1 or teacher_logits.stride(-1) != 1:
        raise ValueError("fused_linear_kd: logits must have a unit stride along the vocabulary dim")
    if use_reference(student_logits):
        loss, grad = reference.kd_loss_and_grad(
            student_logits, teacher_logits, target, temperature, lm_weight, ignore_index, reduction, n_valid
        )
        if write_grad:
            student_logits.copy_(grad)
        return loss
    n_rows, n_cols = student_logits.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=student_logits.device)
    block = min(next_power_of_2(n_cols), MAX_BLOCK)
    if n_rows:
        traceable(_kd_fwd)[(n_rows,)](
            student_logits, student_logits.stride(0), teacher_logits, teacher_logits.stride(0),
            target if target is not None else loss, loss, n_valid, n_cols, ignore_index,
            1.0 / temperature, (1.0 - lm_weight) * temperature**2, lm_weight,
            BLOCK=block, HAS_TARGET=target is not None, LM=lm_weight > 0, WRITE_GRAD=write_grad,
            MEAN=reduction == "mean", num_warps=16 if block >= 8192 else 8,
        )  # fmt: skip
    return loss


def _check(
    student_hidden, student_weight, teacher_hidden, teacher_weight, target, temperature, lm_weight, reduction
):
    if reduction not in ("mean", "sum"):
        raise ValueError(f"fused_linear_kd supports reduction 'mean' or 'sum', got {reduction!r}")
    for name, hidden, weight in (
        ("student", student_hidden, student_weight),
        ("teacher", teacher_hidden, teacher_weight),
    ):
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(
                f"fused_linear_kd expects {name} hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} "
                f"and {tuple(weight.shape)}"
            )
    if (
        teacher_hidden.shape[0] != student_hidden.shape[0]
        or teacher_weight.shape[0] != student_weight.shape[0]
    ):
        raise ValueError(
            "fused_linear_kd: teacher and student must score the same tokens over the same vocabulary, got "
            f"teacher {tuple(teacher_hidden.shape)} x {tuple(teacher_weight.shape)}, student "
            f"{tuple(student_hidden.shape)} x {tuple(student_weight.shape)}"
        )
    if target is not None and target.shape != student_hidden.shape[:1]:
        raise ValueError(f"fused_linear_kd: target must be [N], got {tuple(target.shape)}")
    if not temperature > 0:
        raise ValueError(f"fused_linear_kd: temperature must be positive, got {temperature}")
    if not 0.0 <= lm_weight <= 1.0:
        raise ValueError(f"fused_linear_kd: lm_weight must be in [0, 1], got {lm_weight}")
    if lm_weight > 0 and target is None:
        raise ValueError("fused_linear_kd: lm_weight > 0 needs the targets")


def _fused_linear_kd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None,
    temperature: float,
    lm_weight: float,
    ignore_index: int,
    reduction: str,
    compute_grad: bool,
    weight_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (loss, grad_student_hidden, grad_student_weight); a gradient is empty unless compute_grad
    (grad_student_weight also needs weight_grad: a frozen LM head saves one GEMM per chunk)."""
    _check(student_hidden, student_weight, teacher_hidden, teacher_weight, target, temperature, lm_weight,
           reduction)  # fmt: skip
    n_tokens, hidden_size = student_hidden.shape
    vocab = student_weight.shape[0]
    chunk = chunk_tokens(n_tokens, hidden_size, 2 * vocab)
    if target is None:
        n_valid = torch.tensor(n_tokens, device=student_hidden.device)
    else:
        n_valid = (target != ignore_index).sum()
    losses = torch.empty(n_tokens, dtype=torch.float32, device=student_hidden.device)
    grad_hidden = torch.empty_like(student_hidden) if compute_grad else student_hidden.new_empty(0)
    want_weight = compute_grad and weight_grad
    # (written by the first chunk: accumulate_weight_grad; zeros where there is none)
    grad_weight = (
        (torch.empty_like if n_tokens else torch.zeros_like)(student_weight)
        if want_weight
        else student_weight.new_empty(0)
    )
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        h = student_hidden[start:end]
        student_logits = h @ student_weight.t()
        teacher_logits = teacher_hidden[start:end] @ teacher_weight.t()
        losses[start:end] = launch_kd(
            student_logits,
            teacher_logits,
            None if target is None else target[start:end],
            n_valid,
            temperature,
            lm_weight,
            ignore_index,
            reduction,
            compute_grad,
        )
        del teacher_logits
        if compute_grad:
            torch.matmul(student_logits, student_weight, out=grad_hidden[start:end])
            if want_weight:
                accumulate_weight_grad(grad_weight, student_logits.t(), h, first=start == 0)
    return losses.sum(), grad_hidden, grad_weight


fused_linear_kd = triton_op("squeezeserve::fused_linear_kd", _fused_linear_kd, mutates_args=())


@fused_linear_kd.register_fake
def _(student_hidden, student_weight, teacher_hidden, teacher_weight, target, temperature, lm_weight,
      ignore_index, reduction, compute_grad, weight_grad):  # fmt: skip
    _check(student_hidden, student_weight, teacher_hidden, teacher_weight, target, temperature, lm_weight,
           reduction)  # fmt: skip
    return (
        student_hidden.new_empty((), dtype=torch.float32),
        torch.empty_like(student_hidden) if compute_grad else student_hidden.new_empty(0),
        torch.empty_like(student_weight) if compute_grad and weight_grad else student_weight.new_empty(0),
    )


def _setup(ctx, inputs, output):
    _, grad_hidden, grad_weight = output
    ctx.save_for_backward(grad_hidden, grad_weight)


def _scaled_grads(ctx, grad_loss, in_place: bool) -> tuple:
    grad_hidden, grad_weight = ctx.saved_tensors
    if grad_loss is None:  # the loss was not used (the eager op does not zero-fill unused outputs' grads)
        return (None,) * 11
    if grad_hidden.numel() == 0 and grad_weight.numel() == 0:
        raise RuntimeError("fused_linear_kd: backward called on a forward run with compute_grad=False")
    if in_place and unit_grad(grad_loss):  # (returned as the forward made them)
        return grad_hidden, grad_weight if grad_weight.numel() else None, *(None,) * 9
    g = grad_loss.to(grad_hidden.dtype)
    scale = torch.Tensor.mul_ if in_place else torch.Tensor.mul
    d_weight = scale(grad_weight, g) if grad_weight.numel() else None
    return scale(grad_hidden, g), d_weight, None, None, None, None, None, None, None, None, None


def _grad(ctx, grad_loss, *_unused):
    # Out of place, so that torch.compile can partition it.
    return _scaled_grads(ctx, grad_loss, in_place=False)


def _grad_in_place(ctx, grad_loss, *_unused):
    # Eager: the saved gradients are private buffers, and a scaled copy of grad_weight would double the
    # largest allocation of the backward (so this graph cannot be backpropagated twice).
    return _scaled_grads(ctx, grad_loss, in_place=True)


fused_linear_kd.register_autograd(_grad, setup_context=_setup)

# The same body and formulas for eager calls, without the dispatcher (registry.EagerOp).
fused_linear_kd_eager = EagerOp(_fused_linear_kd, _setup, _grad_in_place, materialize_grads=False)
