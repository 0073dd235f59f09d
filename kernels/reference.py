"""Plain-PyTorch definitions of every squeezeserve op: the CPU implementation and the test oracle.

Forward functions reproduce the eager model code they stand in for, operation by operation, so that a
model patched to call ``torch.ops.squeezeserve.*`` gives bit-identical results on CPU:

- ``rmsnorm`` is Hugging Face's ``LlamaRMSNorm.forward``:
  ``w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``.
- ``swiglu`` is ``LlamaMLP``'s ``silu(gate) * up``, evaluated in the input dtype.

The ``*_backward`` functions are the analytic gradients (the CPU kernels of the backward ops; custom-op
kernels run below autograd, so they cannot differentiate the forward). Tests check them against
autograd through the forward functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from squeezeserve.kernels import codebook_layout, quant_layout

REDUCTIONS = ("mean", "sum", "none")


# --- SwiGLU -------------------------------------------------------------------------------------


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, in the input dtype (Llama's MLP)."""
    return F.silu(gate) * up


def swiglu_backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """d/dgate = g * up * s * (1 + gate * (1 - s)), d/dup = g * silu(gate), with s = sigmoid(gate)."""
    g, a, b = grad.float(), gate.float(), up.float()
    s = torch.sigmoid(a)
    silu = a * s
    d_gate = g * b * s * (1 + a * (1 - s))
    return d_gate.to(gate.dtype), (g * silu).to(up.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """vLLM's packed form: x = [gate | up] along the last dim, [..., 2d] -> [..., d]."""
    d = x.shape[-1] // 2
    return swiglu(x[..., :d], x[..., d:])


def silu_and_mul_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.cat(swiglu_backward(grad, x[..., :d], x[..., d:]), dim=-1)


def swiglu_oai(x: torch.Tensor, y: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss: xc = min(x, limit), yc = clamp(y, -limit, limit), out = xc sigmoid(alpha xc) (yc + 1)."""
    xc = x.clamp(max=limit)
    yc = y.clamp(min=-limit, max=limit)
    return xc * torch.sigmoid(alpha * xc) * (yc + 1)


def swiglu_oai_backward(
    grad: torch.Tensor, x: torch.Tensor, y: torch.Tensor, alpha: float, limit: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """With s = sigmoid(alpha xc): d/dx = g (yc + 1) s (1 + alpha xc (1 - s)) [x <= limit],
    d/dy = g xc s [|y| <= limit].

    At the clamp boundary the gradient passes, as torch.clamp's does.
    """
    g, xf, yf = grad.float(), x.float(), y.float()
    xc = xf.clamp(max=limit)
    yc = yf.clamp(min=-limit, max=limit)
    s = torch.sigmoid(alpha * xc)
    d_x = g * (yc + 1) * s * (1 + alpha * xc * (1 - s)) * (xf <= limit)
    d_y = g * xc * s * ((yf >= -limit) & (yf <= limit))
    return d_x.to(x.dtype), d_y.to(y.dtype)


# --- RMSNorm ------------------------------------------------------------------------------------


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face LlamaRMSNorm: y = w * (x * rsqrt(mean(x^2) + eps)) with the statistics in fp32."""
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def rmsnorm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """With r = rsqrt(mean(x^2) + eps), xhat = x r, gw = g w:
    dx = r (gw - xhat mean(gw xhat)),  dw = sum over rows of g xhat."""
    g, xf, wf = grad.float(), x.float(), weight.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * r
    gw = g * wf
    dx = r * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    dw = (g * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (input dtype, as the decoder layer adds); returns (rmsnorm(h), h)."""
    h = x + residual
    return rmsnorm(h, weight, eps), h


# --- softmax ------------------------------------------------------------------------------------


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, computed in fp32, returned in the input dtype."""
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


def softmax_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """dx = y (g - sum(g y))."""
    g, yf = grad.float(), y.float()
    return (yf * (g - (g * yf).sum(-1, keepdim=True))).to(y.dtype)


# --- cross-entropy ------------------------------------------------------------------------------


def check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _masked(
    loss: torch.Tensor, grad: torch.Tensor, valid: torch.Tensor, reduction: str, n_valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero the ignored rows of per-row losses and their logit gradients; for ``mean`` divide both by the
    valid count (``n_valid`` when the rows are one chunk of a longer batch)."""
    loss = torch.where(valid, loss, 0.0)
    grad = grad * valid[:, None]
    if reduction == "mean":
        count = valid.sum() if n_valid is None else n_valid
        loss, grad = loss / count, grad / count
    return loss, grad


def cross_entropy_loss_and_grad(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    n_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and d(loss)/d(logits) of F.cross_entropy for 2-D logits, in fp32.

    With p = softmax(z), eps = label_smoothing, V = vocabulary size and t the target:
    loss_i = lse_i - (1 - eps) z_it - eps/V sum_j z_ij;  grad_ij = p_ij - (1 - eps)[j == t] - eps/V.
    Ignored rows have zero loss and gradient. 'mean' divides both by ``n_valid`` (the count of
    non-ignored rows, over the whole batch when the caller processes chunks).
    """
    check_reduction(reduction)
    z = logits.float()
    valid = target != ignore_index
    safe_target = torch.where(valid, target, 0).long()
    n_vocab = z.shape[-1]
    lse = torch.logsumexp(z, dim=-1)
    z_t = z.gather(1, safe_target[:, None])[:, 0]
    loss = lse - (1 - label_smoothing) * z_t - label_smoothing / n_vocab * z.sum(-1)
    grad = torch.exp(z - lse[:, None]) - label_smoothing / n_vocab
    grad.scatter_add_(1, safe_target[:, None], torch.full_like(z_t[:, None], -(1 - label_smoothing)))
    return _masked(loss, grad, valid, reduction, n_valid)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """F.cross_entropy on fp32 logits (the oracle for our in-place kernel)."""
    return F.cross_entropy(
        logits.float(),
        target,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
    )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """F.cross_entropy(hidden @ weight.T + bias): the eager path fused_linear_cross_entropy replaces."""
    return cross_entropy(F.linear(hidden, weight, bias), target, ignore_index, label_smoothing, reduction)


# --- weight-only quantized matmul ---------------------------------------------------------------


def quant_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """x @ dequantize(qweight).T with the weight dequantized to ``scales.dtype`` (compressed-tensors'
    order: (q - zero) * scale in the scale dtype), then cast to x's dtype."""
    n_out = qweight.shape[0]
    k_in = x.shape[-1]
    weight = quant_layout.dequantize(qweight, scales, zeros, (n_out, k_in), group_size, bits)
    return F.linear(x, weight.to(x.dtype))


def codebook_matmul(
    x: torch.Tensor, indices: torch.Tensor, codebook: torch.Tensor, group_size: int, bits: int
) -> torch.Tensor:
    """x @ W.T with W = codebook[n, (k // G) * 2**bits + index[n, k]] (``kernels/codebook_layout.py``; the
    op's ``group_size`` 0 means one codebook per output channel), looked up in the codebook dtype, then cast
    to x's dtype."""
    weight = codebook_layout.dequantize(indices, codebook, x.shape[-1], group_size or None, bits)
    return F.linear(x, weight.to(x.dtype))


# --- knowledge distillation ---------------------------------------------------------------------


def kd_loss_and_grad(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: torch.Tensor | None,
    temperature: float,
    lm_weight: float,
    ignore_index: int,
    reduction: str,
    n_valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and d(loss)/d(student logits) of the distillation loss for 2-D logits, in fp32.

    With T = temperature, w = lm_weight, p = softmax(z_t / T), q = softmax(z_s / T), t the target:
    loss_i = (1 - w) T^2 KL(p_i || q_i) + w (lse(z_s,i) - z_s,it);
    grad_ij = (1 - w) T (q_ij - p_ij) + w (softmax(z_s,i)_j - [j == t]).
    Rows whose target is ``ignore_index`` have zero loss and gradient; 'mean' divides by ``n_valid``.
    """
    check_reduction(reduction)
    zs, zt = student_logits.float(), teacher_logits.float()
    log_q = torch.log_softmax(zs / temperature, dim=-1)
    log_p = torch.log_softmax(zt / temperature, dim=-1)
    p = log_p.exp()
    kd_weight = (1 - lm_weight) * temperature**2
    loss = kd_weight * (p * (log_p - log_q)).sum(-1)
    grad = kd_weight / temperature * (log_q.exp() - p)
    valid = torch.ones(zs.shape[0], dtype=torch.bool, device=zs.device)
    if target is not None:
        valid = target != ignore_index
        if lm_weight > 0:
            lm_loss, lm_grad = cross_entropy_loss_and_grad(zs, target, ignore_index, 0.0, "sum")
            loss, grad = loss + lm_weight * lm_loss, grad + lm_weight * lm_grad
    return _masked(loss, grad, valid, reduction, n_valid)


def linear_kd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    temperature: float = 1.0,
    lm_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """The unfused loss fused_linear_kd replaces: both logits materialised, F.kl_div and F.cross_entropy
    (autograd gives the oracle's gradients)."""
    zs = F.linear(student_hidden, student_weight).float()
    zt = F.linear(teacher_hidden, teacher_weight).float()
    kl = F.kl_div(
        F.log_softmax(zs / temperature, -1),
        F.log_softmax(zt / temperature, -1),
        reduction="none",
        log_target=True,
    ).sum(-1)
    loss = (1 - lm_weight) * temperature**2 * kl
    valid = torch.ones_like(kl, dtype=torch.bool)
    if target is not None:
        valid = target != ignore_index
        if lm_weight > 0:
            loss = loss + lm_weight * F.cross_entropy(zs, target, ignore_index=ignore_index, reduction="none")
    loss = loss * valid
    return loss.sum() / valid.sum() if reduction == "mean" else loss.sum()
