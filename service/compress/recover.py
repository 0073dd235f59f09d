"""Recovery fine-tune after pruning: a few AdamW steps of plain next-token loss on calibration text,
training only the pruned Linears and re-applying their masks after every step (pruned weights stay 0).

Memory: the loss is our fused linear cross-entropy (``squeezeserve.kernels.functional``), which never
materialises the [tokens, vocab] logits (49k-wide here: the largest activation of a small model), and the
decoder layers recompute their activations in the backward (gradient checkpointing). Embeddings, norms and
the (tied) LM head are frozen, so optimizer state covers the Linears only.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from tqdm.auto import tqdm

from squeezeserve.service.compress.options import CompressOptions
from squeezeserve.service.compress.prune import enforce_mask


def recover(
    model: nn.Module, masks: dict[str, torch.Tensor], input_ids: torch.Tensor, options: CompressOptions
) -> list[float]:
    """Fine-tune ``model`` in place for ``options.recover_steps`` steps; returns the loss of each step."""
    from squeezeserve.kernels.functional import fused_linear_cross_entropy

    modules = {name: model.get_submodule(name) for name in masks}
    params = [m.weight for m in modules.values()]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=options.recover_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(options.seed)
    was_training = model.training
    model.train()
    with warnings.catch_warnings():  # transformers 5 renames it (activation_checkpointing_*) without kwargs
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    losses = []
    try:
        for _ in tqdm(range(options.recover_steps), desc="recovery fine-tune", unit="step"):
            rows = torch.randint(0, input_ids.shape[0], (options.recover_batch_size,), generator=generator)
            batch = input_ids[rows].to(model.device)
            hidden = model.model(input_ids=batch, use_cache=False).last_hidden_state
            loss = fused_linear_cross_entropy(
                hidden[:, :-1].reshape(-1, hidden.shape[-1]),
                model.lm_head.weight,
                batch[:, 1:].reshape(-1),
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for name, module in modules.items():
                module.weight.grad.mul_(masks[name])
            optimizer.step()
            with torch.no_grad():
                for name, module in modules.items():
                    module.weight.data = enforce_mask(module.weight.data, masks[name])
            losses.append(float(loss.detach()))
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_disable()
        model.train(was_training)
        for p in params:
            p.requires_grad_(False)
            p.grad = None
    return losses
