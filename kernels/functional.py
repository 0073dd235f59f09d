"""Thin functional API over ``torch.ops.squeezeserve.*`` (autograd-aware; CPU tensors run the reference).

Eager calls run the op bodies directly (``registry.EagerOp``: same kernels, same gradients, no dispatcher
overhead), or first their launch plans replayed in C++ (``LaunchPlans.native``: no Python layer at all);
traced and compiled calls go through the registered ops.
"""

from __future__ import annotations

import torch

from squeezeserve.kernels import registry
from squeezeserve.kernels.ops import codebook_matmul as _codebook_matmul
from squeezeserve.kernels.ops import cross_entropy as _cross_entropy
from squeezeserve.kernels.ops import fused_linear_ce as _fused_linear_ce
from squeezeserve.kernels.ops import fused_linear_kd as _fused_linear_kd
from squeezeserve.kernels.ops import quant_matmul as _quant_matmul
from squeezeserve.kernels.ops import rmsnorm as _rmsnorm
from squeezeserve.kernels.ops import softmax as _softmax
from squeezeserve.kernels.ops import swiglu as _swiglu

registry.load()
_ops = torch.ops.squeezeserve
# Each op's launch plans: a call tries their C++ replay first, inlined below (``LaunchPlans.replayed`` without
# its frame; the H100's host, tests/gpu/launch_probe.py: a softmax 1x4096 call took 7.0 us through that frame
# with the hook, device and stream checks in Python, 6.4 inlined with them in C++; torch.softmax 6.6 and 6.4).
# torch.compile is checked before the replayer is read: dynamo then never guards on it.
_swiglu_plans = _swiglu.swiglu_eager.plans
_silu_and_mul_plans = _swiglu.silu_and_mul_eager.plans
_swiglu_oai_plans = _swiglu.swiglu_oai_eager.plans
_rmsnorm_plans = _rmsnorm.rmsnorm_eager.plans
_add_rmsnorm_plans = _rmsnorm.add_rmsnorm_eager.plans
_softmax_plans = _softmax.softmax_eager.plans


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    if not torch.compiler.is_compiling() and (replay := _swiglu_plans.native) is not None:
        out = replay(gate, up)
        if out is not None:
            return out
    if registry.eager(gate, up):
        return _swiglu.swiglu_eager(gate, up)
    return _ops.swiglu(gate, up)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d]: silu(x[..., :d]) * x[..., d:] (vLLM's packed form)."""
    if not torch.compiler.is_compiling() and (replay := _silu_and_mul_plans.native) is not None:
        out = replay(x)
        if out is not None:
            return out
    if registry.eager(x):
        return _swiglu.silu_and_mul_eager(x)
    return _ops.silu_and_mul(x)


def swiglu_oai(x: torch.Tensor, y: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss: min(x, limit) * sigmoid(alpha * min(x, limit)) * (clamp(y, -limit, limit) + 1)."""
    if not torch.compiler.is_compiling() and (replay := _swiglu_oai_plans.native) is not None:
        out = replay(x, y, alpha, limit)
        if out is not None:
            return out
    if registry.eager(x, y):
        return _swiglu.swiglu_oai_eager(x, y, alpha, limit)
    return _ops.swiglu_oai(x, y, alpha, limit)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), statistics in fp32 (Hugging Face Llama's rounding)."""
    if not torch.compiler.is_compiling() and (replay := _rmsnorm_plans.native) is not None:
        out = replay(x, weight, eps)
        if out is not None:
            return out
    if registry.eager(x, weight):
        return _rmsnorm.rmsnorm_eager(x, weight, eps)
    return _ops.rmsnorm(x, weight, eps)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; returns (rmsnorm(h, weight, eps), h)."""
    if not torch.compiler.is_compiling() and (replay := _add_rmsnorm_plans.native) is not None:
        out = replay(x, residual, weight, eps)
        if out is not None:
            return out
    if registry.eager(x, residual, weight):
        return _rmsnorm.add_rmsnorm_eager(x, residual, weight, eps)
    return _ops.add_rmsnorm(x, residual, weight, eps)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim (any width; rows wider than one block are split across programs)."""
    if not torch.compiler.is_compiling() and (replay := _softmax_plans.native) is not None:
        out = replay(x)
        if out is not None:
            return out
    if registry.eager(x):
        return _softmax.softmax_eager(x)
    return _ops.softmax(x)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """F.cross_entropy for [N, V] logits, Liger-style. When logits require grad, their buffer is
    overwritten by the gradient during the forward (do not reuse the logits afterwards)."""
    return _cross_entropy.cross_entropy(logits, target, ignore_index, label_smoothing, reduction)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """F.cross_entropy(hidden @ weight.T + bias, target) without materialising the logits; the gradients
    are computed during the forward when any input requires grad."""
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    args = (hidden, weight, target, bias, ignore_index, label_smoothing, reduction, needs_grad)
    if registry.eager(hidden, weight, target, bias):
        return _fused_linear_ce.fused_linear_cross_entropy_eager(*args)[0]
    return _ops.fused_linear_cross_entropy(*args)[0]


def fused_linear_kd(
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
    """(1 - lm_weight) T^2 KL(softmax(teacher_hidden @ teacher_weight.T / T) || softmax(student ... / T))
    + lm_weight * cross-entropy(student logits, target), without materialising either logits tensor; the
    student's gradients are computed during the forward (the teacher gets none)."""
    grad = torch.is_grad_enabled() and (student_hidden.requires_grad or student_weight.requires_grad)
    weight_grad = grad and student_weight.requires_grad
    teacher = (teacher_hidden.detach(), teacher_weight.detach())
    args = (student_hidden, student_weight, *teacher, target, temperature, lm_weight, ignore_index, reduction,
            grad, weight_grad)  # fmt: skip
    if registry.eager(student_hidden, student_weight, teacher_hidden, teacher_weight, target):
        return _fused_linear_kd.fused_linear_kd_eager(*args)[0]
    return _ops.fused_linear_kd(*args)[0]


def quant_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """x @ W.T for W in compressed-tensors' pack-quantized layout (see ``kernels/quant_layout.py``)."""
    if registry.eager(x, qweight, scales, zeros):  # (without torch's dispatcher, with launch plans)
        return _quant_matmul.quant_matmul_eager(x, qweight, scales, zeros, group_size, bits)
    return _ops.quant_matmul(x, qweight, scales, zeros, group_size, bits)


def codebook_matmul(
    x: torch.Tensor, indices: torch.Tensor, codebook: torch.Tensor, group_size: int, bits: int
) -> torch.Tensor:
    """x @ W.T for W in the codebook layout (``kernels/codebook_layout.py``; ``group_size`` 0: one codebook
    per output channel)."""
    if registry.eager(x, indices, codebook):  # (without torch's dispatcher)
        return _codebook_matmul.codebook_matmul_eager(x, indices, codebook, group_size, bits)
    return _ops.codebook_matmul(x, indices, codebook, group_size, bits)
