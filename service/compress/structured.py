"""Structured pruning: remove whole MLP neurons, attention heads or decoder layers, leaving a smaller
*dense* model whose config.json is a plain Llama config (smaller ``intermediate_size``,
``num_attention_heads`` or ``num_hidden_layers``) that transformers, the embedded worker and vLLM load with
no plugin and run faster with no special kernel.

**Importance: the output energy a group removes, from calibration activations.** A group of input columns
``S`` of a layer's output projection (one MLP neuron: a column of ``down_proj``; one attention head: its
``head_dim`` columns of ``o_proj``) adds ``X_S W_S^T`` to the residual stream, ``X_S`` being those columns
of the projection's inputs over the calibration tokens. Removing the group removes exactly that term; its
squared size summed over every token is

    score(S) = ||X_S W_S^T||_F^2 = trace(W_S H_SS W_S^T),   H = X^T X  (the Gram ``layerwise`` records)

an exact, forward-only measure of what the group contributes (cross-terms between groups ignored, as in
Wanda, whose unstructured score ``|W_ij| ||X_j||`` is this with one weight per group). Why not the
alternatives: weight magnitude ignores the activations, and the hidden states' scale varies by orders of
magnitude between channels and layers (RMSNorm gains); first-order Taylor scores ``|g . w|`` need a backward
pass through the whole model and are noisy on a few hundred calibration windows, where the activations'
second moment is already well estimated. Layers are pruned one after the other (``layerwise``), so each
layer is scored on what the already pruned layers before it compute.

Every layer keeps the same number of neurons / heads (a plain config has one ``intermediate_size`` and
one head count), the lowest-scoring within each layer go.

- ``mlp-width``: each layer keeps ``(1 - ratio)`` of its neurons (rows of gate/up, columns of down),
  rounded to a multiple of ``WIDTH_MULTIPLE`` (our int4 group size, so the pruned model still quantizes
  with g32 and packs into int32 words).
- ``heads`` (grouped-query attention): **query heads are pruned within each KV group, the same number in
  every group**; key/value heads all stay. Query head ``h`` attends with KV head ``h // n_rep``, so keeping
  ``k`` heads of every group leaves a valid GQA layout (``n_rep = k``) and the KV cache unchanged. Pruning
  whole KV groups instead would shrink the cache too but only in steps of one group (a third of the
  attention at once on the bundled model, 9 query / 3 KV heads), and each group takes its KV head with it.
  ``head_dim`` is written into the config explicitly (``hidden_size / num_heads`` no longer is); the
  kept head count must still divide ``hidden_size`` (transformers' ``LlamaConfig`` checks it).
- ``layers``: whole decoder layers with the lowest *block influence* (ShortGPT, Men et al. 2024): one
  minus the mean cosine similarity between a layer's input and output hidden states over the calibration
  tokens -- a layer that barely turns the residual stream is nearly an identity. Scored in one forward
  pass of the unpruned model.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from squeezeserve.service.compress.calibration import decoder_layers, layerwise
from squeezeserve.service.compress.options import STRUCTURES

WIDTH_MULTIPLE = 32


def check_ratio(structure: str, ratio: float) -> None:
    """Refuse an unknown structure or a ratio outside (0, 1) with a sentence."""
    if structure not in STRUCTURES:
        raise ValueError(f"unknown --structure {structure!r}: choose one of {', '.join(STRUCTURES)}")
    if not 0.0 < ratio < 1.0:
        raise ValueError(f"--ratio is the fraction removed: 0 < ratio < 1, got {ratio}")


def kept_count(total: int, ratio: float, multiple: int = 1, what: str = "units") -> int:
    """How many of ``total`` stay when ``ratio`` of them go, rounded to ``multiple`` (at least one
    ``multiple``); raises when that removes nothing or everything."""
    kept = max(multiple, int(round(total * (1.0 - ratio) / multiple)) * multiple)
    if kept >= total:
        raise ValueError(
            f"--ratio {ratio} removes nothing from {total} {what} (kept counts round to multiples of "
            f"{multiple}): choose a larger ratio"
        )
    return kept


def group_scores(weight: torch.Tensor, gram: torch.Tensor, group: int) -> torch.Tensor:
    """``trace(W_S H_SS W_S^T)`` for each run ``S`` of ``group`` input columns of ``weight`` [out, in]:
    the squared norm of what those columns add to the output, summed over the calibration tokens."""
    w = weight.detach().to(torch.float32)
    n_groups = w.shape[1] // group
    # (W_S H_SS) summed elementwise with W_S, per group: [out, g, group] x [g, group, group].
    blocks = gram.reshape(n_groups, group, n_groups, group).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    ws = w.reshape(w.shape[0], n_groups, group)
    return torch.einsum("ogi,gij,ogj->g", ws, blocks, ws)


def _shrink(linear: nn.Linear, dim: int, index: torch.Tensor) -> None:
    """Keep only ``index`` along ``dim`` of ``linear.weight`` (0: output rows, 1: input columns)."""
    weight = linear.weight.data.index_select(dim, index.to(linear.weight.device)).contiguous()
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if dim == 0:
        linear.out_features = weight.shape[0]
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.data[index].contiguous(), requires_grad=False)
    else:
        linear.in_features = weight.shape[1]


def prune_mlp_width(layer: nn.Module, gram: torch.Tensor, keep: int) -> torch.Tensor:
    """Keep the ``keep`` highest-scoring neurons of ``layer.mlp``; returns their (sorted) indices."""
    mlp = layer.mlp
    scores = group_scores(mlp.down_proj.weight, gram, 1)
    index = scores.topk(keep).indices.sort().values
    _shrink(mlp.gate_proj, 0, index)
    _shrink(mlp.up_proj, 0, index)
    _shrink(mlp.down_proj, 1, index)
    mlp.intermediate_size = keep
    return index


def prune_query_heads(layer: nn.Module, gram: torch.Tensor, keep_per_group: int) -> torch.Tensor:
    """Keep the ``keep_per_group`` highest-scoring query heads of every KV group; returns kept heads."""
    attn = layer.self_attn
    head_dim = attn.head_dim
    n_rep = attn.num_key_value_groups
    scores = group_scores(attn.o_proj.weight, gram, head_dim)  # [heads], head h in KV group h // n_rep
    per_group = scores.view(-1, n_rep)
    local = per_group.topk(keep_per_group, dim=1).indices.sort(dim=1).values
    heads = (local + torch.arange(per_group.shape[0], device=local.device)[:, None] * n_rep).flatten()
    columns = (heads[:, None] * head_dim + torch.arange(head_dim, device=heads.device)).flatten()
    _shrink(attn.q_proj, 0, columns)
    _shrink(attn.o_proj, 1, columns)
    attn.num_key_value_groups = keep_per_group
    return heads


@torch.no_grad()
def block_influence(model: nn.Module, input_ids: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """Per decoder layer, ``1 - mean cos(h_in, h_out)`` over every calibration token (ShortGPT)."""
    layers = decoder_layers(model)
    total = torch.zeros(len(layers), dtype=torch.float64)

    def measure(module: nn.Module, args: tuple, kwargs: dict, output: Any, index: int) -> None:
        before = args[0] if args else kwargs["hidden_states"]
        after = output[0] if isinstance(output, tuple) else output
        cos = nn.functional.cosine_similarity(before.float(), after.float(), dim=-1)
        total[index] += float((1 - cos).sum())

    hooks = [
        layer.register_forward_hook(functools.partial(measure, index=i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    try:
        for start in range(0, input_ids.shape[0], batch_size):
            model.model(input_ids=input_ids[start : start + batch_size].to(model.device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return (total / input_ids.numel()).float()


def prune_layers(model: nn.Module, input_ids: torch.Tensor, ratio: float) -> list[int]:
    """Remove the decoder layers of lowest block influence; returns the removed indices."""
    layers = decoder_layers(model)
    keep = kept_count(len(layers), ratio, what="layers")
    influence = block_influence(model, input_ids)
    removed = sorted(influence.topk(len(layers) - keep, largest=False).indices.tolist())
    kept = [layer for i, layer in enumerate(layers) if i not in set(removed)]
    for index, layer in enumerate(kept):
        layer.self_attn.layer_idx = index  # the KV cache slot
    model.model.layers = nn.ModuleList(kept)
    return removed


def structured_prune(
    model: nn.Module, structure: str, ratio: float, input_ids: torch.Tensor
) -> dict[str, Any]:
    """Prune ``model`` in place; returns ``{"config": {key: new value}, "removed": ...}`` where ``config``
    holds the config.json entries that change (also set on ``model.config``)."""
    check_ratio(structure, ratio)
    config = model.config
    updates: dict[str, Any]
    removed: Any
    if structure == "layers":
        removed = prune_layers(model, input_ids, ratio)
        updates = {"num_hidden_layers": len(decoder_layers(model))}
    elif structure == "mlp-width":
        keep = kept_count(config.intermediate_size, ratio, WIDTH_MULTIPLE, "MLP neurons")
        removed = None  # the same count in every layer: the config says it

        def prune_mlp(index: int, _linears: dict, grams: dict[str, torch.Tensor]) -> None:
            prune_mlp_width(model.model.layers[index], grams[f"model.layers.{index}.mlp.down_proj"], keep)

        layerwise(model, input_ids, prune_mlp, desc=f"pruning mlp-width {ratio:g}")
        updates = {"intermediate_size": keep}
    else:
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        keep_per_group = kept_count(heads // kv_heads, ratio, what="query heads per KV group")
        if config.hidden_size % (keep_per_group * kv_heads):
            # transformers' LlamaConfig refuses it at load time, head_dim given or not.
            raise ValueError(
                f"--ratio {ratio} keeps {keep_per_group * kv_heads} attention heads, which do not divide "
                f"hidden_size {config.hidden_size} (transformers' Llama config requires it): choose another "
                "ratio"
            )
        kept_heads: dict[int, list[int]] = {}

        def prune_heads(index: int, _linears: dict, grams: dict[str, torch.Tensor]) -> None:
            gram = grams[f"model.layers.{index}.self_attn.o_proj"]
            kept_heads[index] = prune_query_heads(model.model.layers[index], gram, keep_per_group).tolist()

        layerwise(model, input_ids, prune_heads, desc=f"pruning heads {ratio:g}")
        removed = {i: sorted(set(range(heads)) - set(kept)) for i, kept in kept_heads.items()}
        updates = {"num_attention_heads": keep_per_group * kv_heads, "head_dim": head_dim}
    for key, value in updates.items():
        setattr(config, key, value)
    return {"config": updates, "removed": removed}


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters (a tied LM head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def describe(updates: dict[str, Any], before: int, after: int) -> str:
    changes = ", ".join(f"{k}={v}" for k, v in updates["config"].items())
    return f"structured pruning: {changes}; parameters {before:,} -> {after:,} ({after / before:.2f}x)"


def write_config_updates(out: Path, config: dict[str, Any], updates: dict[str, Any]) -> dict[str, Any]:
    """Rewrite ``out/config.json`` (already written as ``config``) with the structural ``updates``."""
    config = {**config, **updates}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config
