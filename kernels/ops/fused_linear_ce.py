"""Fused linear cross-entropy: loss of ``hidden @ weight.T + bias`` without materialising [N, V] logits.

The forward walks token chunks. For each chunk it computes the chunk's logits (one matmul), runs the
cross-entropy kernel over them in place (loss, and d(loss)/d(logits) written over the chunk), and folds
that gradient straight into the parameter gradients:

    grad_hidden[chunk] = grad_logits @ weight        grad_weight += grad_logits.T @ hidden[chunk]
    grad_bias += grad_logits.sum(0)

so the backward only scales the saved gradients by the incoming scalar. Live memory beyond the inputs
and the gradients themselves is one chunk of logits (one buffer reused by every chunk): the chunk holds
about as many elements as ``hidden`` does (Liger's rule), i.e. chunk = next_pow2(N / ceil(V / H)) tokens.

grad_weight accumulates in the weight's dtype (as Liger does): each addmm accumulates in fp32 inside
the GEMM and rounds once per chunk; the saved fp32 alternative would double the memory of the largest
gradient. The first chunk writes it (no zero fill before, no read of it: :func:`accumulate_weight_grad`),
and the eager backward hands the gradients back untouched where the incoming gradient is 1
(:func:`unit_grad`). Reductions 'mean' and 'sum' only ('none' would need per-token scales in the backward).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.library import triton_op

from squeezeserve.kernels.ops.cross_entropy import launch_cross_entropy
from squeezeserve.kernels.ops.launch import cdiv, next_power_of_2
from squeezeserve.kernels.registry import EagerOp


def chunk_tokens(n_tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Tokens per chunk so that a chunk of logits holds about as many elements as the hidden states."""
    growth = cdiv(vocab_size, hidden_size)
    return max(1, next_power_of_2(cdiv(max(n_tokens, 1), growth)))


def accumulate_weight_grad(
    grad_weight: torch.Tensor, grad_logits_t: torch.Tensor, h: torch.Tensor, first: bool
):
    """grad_weight += grad_logits.T @ h, where the first chunk writes it: no zero fill of the gradient
    before the loop and no read of it in the first product (at V=128k, H=4096 the bf16 gradient is 1.05 GB:
    about 0.35 ms each on an H100)."""
    if first:
        torch.matmul(grad_logits_t, h, out=grad_weight)
    else:
        grad_weight.addmm_(grad_logits_t, h)


def unit_grad(grad_loss: torch.Tensor) -> bool:
    """Whether the loss's incoming gradient is exactly 1 (``loss.backward()``), read on the host: the eager
    backward then returns the gradients the forward made as they are, where scaling them would read and
    write each once (grad_weight 1.05 GB at V=128k, H=4096: ~0.7 ms on an H100). Liger reads it the same
    way. Never while a CUDA graph is being captured (no host read there: the gradients are scaled)."""
    if grad_loss.numel() != 1 or (grad_loss.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    return bool(grad_loss.item() == 1)


def _check(hidden, weight, target, bias, reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"fused_linear_cross_entropy supports reduction 'mean' or 'sum', got {reduction!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"fused_linear_cross_entropy expects hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}"
        )
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"fused_linear_cross_entropy: target must be [N], got {tuple(target.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"fused_linear_cross_entropy: bias must be [V], got {tuple(bias.shape)}")


def _fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (loss, grad_hidden, grad_weight, grad_bias); the gradients are empty unless compute_grad
    (grad_bias is empty when there is no bias)."""
    _check(hidden, weight, target, bias, reduction)
    n_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    chunk = chunk_tokens(n_tokens, hidden_size, vocab)
    n_valid = (target != ignore_index).sum()
    losses = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if compute_grad else hidden.new_empty(0)
    # (written by the first chunk: accumulate_weight_grad; zeros where there is none)
    grad_weight = (
        (torch.empty_like if n_tokens else torch.zeros_like)(weight) if compute_grad else weight.new_empty(0)
    )
    grad_bias = torch.zeros_like(bias) if (compute_grad and bias is not None) else hidden.new_empty(0)
    # One logits buffer for every chunk: `logits = h @ weight.t()` per chunk would allocate the next chunk's
    # logits while the last chunk's are still alive (two chunks at the peak: 1381 MB at N=16k, V=128k,
    # H=4096, 1256 with the buffer, H100; tests/benchmarks/NOTES.md).
    buffer = hidden.new_empty(
        (min(chunk, n_tokens), vocab), dtype=torch.promote_types(hidden.dtype, weight.dtype)
    )
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        h = hidden[start:end]
        logits = buffer[: end - start]
        if bias is None:
            torch.matmul(h, weight.t(), out=logits)
        else:
            torch.addmm(bias, h, weight.t(), out=logits)
        losses[start:end] = launch_cross_entropy(
            logits, target[start:end], n_valid, ignore_index, label_smoothing, reduction, compute_grad
        )
        if compute_grad:
            torch.matmul(logits, weight, out=grad_hidden[start:end])
            accumulate_weight_grad(grad_weight, logits.t(), h, first=start == 0)
            if bias is not None:
                grad_bias += logits.sum(0, dtype=torch.float32).to(bias.dtype)
    return losses.sum(), grad_hidden, grad_weight, grad_bias


fused_linear_cross_entropy_ = triton_op(
    "squeezeserve::fused_linear_cross_entropy", _fused_linear_cross_entropy, mutates_args=()
)


@fused_linear_cross_entropy_.register_fake
def _(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, compute_grad):
    _check(hidden, weight, target, bias, reduction)
    return (
        hidden.new_empty((), dtype=torch.float32),
        torch.empty_like(hidden) if compute_grad else hidden.new_empty(0),
        torch.empty_like(weight) if compute_grad else weight.new_empty(0),
        torch.empty_like(bias) if (compute_grad and bias is not None) else hidden.new_empty(0),
    )


def _setup(ctx, inputs, output):
    _, grad_hidden, grad_weight, grad_bias = output
    ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
    ctx.has_bias = inputs[3] is not None


def _grad(ctx, grad_loss, *_unused, in_place=False):
    """The gradients were computed in the forward: scale them by the incoming scalar. Out of place for the
    registered op (torch.compile partitions it); in place on the eager path, where the saved gradients are
    private buffers and a scaled copy of grad_weight would double the largest allocation of the backward
    (so an eager graph cannot be backpropagated twice), and not at all there for a gradient of 1
    (:func:`unit_grad`)."""
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    if grad_loss is None:  # the loss was not used (the eager op does not zero-fill unused outputs' grads)
        return (None,) * 8
    if grad_hidden.numel() == 0 and grad_weight.numel() == 0:
        raise RuntimeError(
            "fused_linear_cross_entropy: backward called on a forward run with compute_grad=False"
        )
    if in_place and unit_grad(grad_loss):
        return grad_hidden, grad_weight, None, grad_bias if ctx.has_bias else None, None, None, None, None
    scale = torch.Tensor.mul_ if in_place else torch.mul
    g = grad_loss.to(grad_hidden.dtype)
    d_bias = scale(grad_bias, g) if ctx.has_bias else None
    return scale(grad_hidden, g), scale(grad_weight, g), None, d_bias, None, None, None, None


fused_linear_cross_entropy_.register_autograd(_grad, setup_context=_setup)
# The same body and formula for eager calls, without the dispatcher (registry.EagerOp).
fused_linear_cross_entropy_eager = EagerOp(
    _fused_linear_cross_entropy, _setup, partial(_grad, in_place=True), materialize_grads=False
)
