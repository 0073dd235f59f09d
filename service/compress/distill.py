"""Recovery after pruning: a few AdamW steps on calibration text, by distillation or by next-token loss.

- ``kd`` (knowledge distillation, Hinton et al. 2015): the student learns the teacher's whole next-token
  distribution, ``T^2 KL(softmax(z_t / T) || softmax(z_s / T))`` per token, optionally mixed with the
  LM loss (``kd_lm_weight``). The teacher is the unpruned source model (or ``--teacher``). The loss is our
  ``fused_linear_kd`` op: teacher and student hidden states go in with their LM heads, and neither
  ``[tokens, vocab]`` logits tensor exists beyond one chunk of tokens (49k-wide here: the largest
  activation of a small model, twice).
- ``lm``: plain next-token cross-entropy through our fused linear cross-entropy (one vocabulary pass).

Only the decoder Linears train; embeddings, norms and the (tied) LM head are frozen, so optimizer state
covers the Linears only. A Linear with a pruning mask (unstructured / 2:4, or any exact zeros in a
checkpoint handed to ``--method distill``) gets it re-applied after every step, so pruned weights stay 0.
The student's decoder layers recompute their activations in the backward (gradient checkpointing); the
teacher runs under ``no_grad``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from squeezeserve.service.compress.options import CompressOptions
from squeezeserve.service.compress.prune import enforce_mask


def zero_masks(linears: dict[str, nn.Linear]) -> dict[str, torch.Tensor | None]:
    """Keep-mask per Linear where its weight has exact zeros (a pruned checkpoint), else None."""
    return {name: m.weight != 0 if bool((m.weight == 0).any()) else None for name, m in linears.items()}


def next_token_loss(
    student: nn.Module, teacher: nn.Module | None, batch: torch.Tensor, options: CompressOptions
) -> torch.Tensor:
    """The recovery loss of one batch of windows ``[rows, seq]`` (mean over predicted tokens)."""
    from squeezeserve.kernels.functional import fused_linear_cross_entropy, fused_linear_kd

    hidden = student.model(input_ids=batch, use_cache=False).last_hidden_state
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    target = batch[:, 1:].reshape(-1)
    if options.recover_loss == "lm":
        return fused_linear_cross_entropy(hidden, student.lm_head.weight, target)
    if teacher is None:
        raise ValueError("kd recovery needs a teacher model")
    with torch.no_grad():
        teacher_hidden = teacher.model(input_ids=batch, use_cache=False).last_hidden_state
    teacher_hidden = teacher_hidden[:, :-1].reshape(-1, teacher_hidden.shape[-1])
    return fused_linear_kd(
        hidden,
        student.lm_head.weight,
        teacher_hidden,
        teacher.lm_head.weight,
        target if options.kd_lm_weight > 0 else None,
        temperature=options.temperature,
        lm_weight=options.kd_lm_weight,
    )


def distill(
    student: nn.Module,
    teacher: nn.Module | None,
    trained: dict[str, torch.Tensor | None],
    input_ids: torch.Tensor,
    options: CompressOptions,
) -> list[float]:
    """Fine-tune the Linears named in ``trained`` (name -> keep-mask or None) of ``student`` in place for
    ``options.recover_steps`` steps of ``options.recover_loss``; returns each step's loss."""
    modules = {name: student.get_submodule(name) for name in trained}
    masked = {name: mask for name, mask in trained.items() if mask is not None}

    def keep_masks() -> None:
        for name, mask in masked.items():
            modules[name].weight.data = enforce_mask(modules[name].weight.data, mask)

    def mask_grads() -> None:
        for name, mask in masked.items():
            modules[name].weight.grad.mul_(mask)

    params = [m.weight for m in modules.values()]
    return fine_tune(student, teacher, params, input_ids, options, mask_grads, keep_masks)


@torch.enable_grad()  # a caller under no_grad still trains
def fine_tune(
    student: nn.Module,
    teacher: nn.Module | None,
    params: list[nn.Parameter],
    input_ids: torch.Tensor,
    options: CompressOptions,
    after_backward: Callable[[], None] | None = None,
    after_step: Callable[[], None] | None = None,
) -> list[float]:
    """``options.recover_steps`` AdamW steps of ``options.recover_loss`` on ``params`` (everything else in
    ``student`` frozen), each on ``options.recover_batch_size`` random windows of ``input_ids``; the hooks
    run after each backward (e.g. to mask gradients) and each step (e.g. to re-apply constraints). Returns
    each step's loss; ``params`` are left frozen."""
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=options.recover_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(options.seed)
    was_training = student.training
    student.train()
    if teacher is not None:
        teacher.eval()
    with warnings.catch_warnings():  # transformers 5 renames it (activation_checkpointing_*) without kwargs
        warnings.simplefilter("ignore", FutureWarning)
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    losses = []
    desc = f"recovery ({options.recover_loss})"
    try:
        for _ in tqdm(range(options.recover_steps), desc=desc, unit="step"):
            rows = torch.randint(0, input_ids.shape[0], (options.recover_batch_size,), generator=generator)
            loss = next_token_loss(student, teacher, input_ids[rows].to(student.device), options)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if after_backward is not None:
                after_backward()
            optimizer.step()
            if after_step is not None:
                with torch.no_grad():
                    after_step()
            losses.append(float(loss.detach()))
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            student.gradient_checkpointing_disable()
        student.train(was_training)
        for p in params:
            p.requires_grad_(False)
            p.grad = None
    return losses
