"""Calibration data and the layer-by-layer pass that GPTQ and Wanda calibrate on.

``calibration_batches`` cuts a text file into ``samples`` windows of ``seq_len`` tokens. ``layerwise``
runs them through the model one decoder layer at a time: it records each Linear's input Gram matrix
``H = X^T X`` (``X``: that layer's inputs, one row per token), lets the caller rewrite the layer's weights
(prune, quantize), then recomputes the layer's outputs *with the rewritten weights* as the next layer's
inputs, so later layers calibrate on what they will really see (as in the GPTQ and SparseGPT papers).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm


@dataclass(frozen=True)
class Calibration:
    input_ids: torch.Tensor  # [samples, seq_len]
    path: str
    sha256: str


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def calibration_batches(path: str | Path, tokenizer: Any, samples: int, seq_len: int) -> Calibration:
    """``samples`` consecutive, non-overlapping windows of ``seq_len`` tokens from the start of ``path``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file {path} does not exist")
    if samples < 1 or seq_len < 2:
        raise ValueError(f"need at least 1 sample of 2 tokens, got {samples} x {seq_len}")
    need = samples * seq_len
    # Tokenize only as much text as the windows need (about 4 characters a token, with margin).
    text = path.read_text(encoding="utf-8", errors="replace")[: need * 8]
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    if ids.numel() < need:
        raise ValueError(
            f"calibration file {path} has {ids.numel()} tokens; {samples} x {seq_len} = {need} are needed"
        )
    return Calibration(ids[:need].view(samples, seq_len).clone(), str(path), file_sha256(path))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers: only decoder-only LMs are supported")
    return layers


def linear_modules(module: nn.Module, prefix: str = "") -> dict[str, nn.Linear]:
    return {
        f"{prefix}{name}": child for name, child in module.named_modules() if isinstance(child, nn.Linear)
    }


class _Stop(Exception):
    pass


LayerFn = Callable[[int, dict[str, nn.Linear], dict[str, torch.Tensor]], None]


@torch.no_grad()
def layerwise(
    model: nn.Module, input_ids: torch.Tensor, fn: LayerFn, batch_size: int = 8, desc: str = ""
) -> None:
    """Run ``fn(layer_index, linears, grams)`` for each decoder layer in order (see module docstring).

    ``linears`` maps full module names (``model.layers.3.mlp.down_proj``) to modules; ``grams`` maps the
    same names to float32 ``X^T X`` ``[in, in]`` summed over every calibration token. Linears that read the
    very same input tensor (q/k/v, gate/up) share one Gram tensor object (``grams[a] is grams[b]``).
    """
    layers = decoder_layers(model)
    inputs: list[tuple[torch.Tensor, dict[str, Any]]] = []

    def capture(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        inputs.append((hidden, {k: v for k, v in kwargs.items() if k != "hidden_states"}))
        raise _Stop

    handle = layers[0].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        for start in range(0, input_ids.shape[0], batch_size):
            try:
                batch = input_ids[start : start + batch_size].to(model.device)
                model(input_ids=batch, use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()

    for index, layer in enumerate(tqdm(layers, desc=desc or "calibrating", unit="layer")):
        linears = linear_modules(layer, prefix=f"model.layers.{index}.")
        grams = input_grams(layer, linears, inputs)
        fn(index, linears, grams)
        inputs = [(_hidden_of(layer(hidden, **kwargs)), kwargs) for hidden, kwargs in inputs]


def input_grams(
    layer: nn.Module, linears: dict[str, nn.Linear], inputs: list[tuple[torch.Tensor, dict[str, Any]]]
) -> dict[str, torch.Tensor]:
    """Run ``layer`` over ``inputs`` and return each linear's float32 input Gram matrix ``X^T X``.

    Linears that read the very same tensor (q/k/v, gate/up) get one shared Gram tensor, computed once."""
    grams: dict[str, torch.Tensor] = {}
    batch_inputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (input, its Gram) seen in this batch

    def accumulate(module: nn.Linear, args: tuple, _out: Any, name: str) -> None:
        x = args[0]
        for seen, gram in batch_inputs:
            if seen is x:
                grams.setdefault(name, gram)
                return
        gram = grams.setdefault(name, torch.zeros(module.in_features, module.in_features, device=x.device))
        flat = x.reshape(-1, x.shape[-1]).to(torch.float32)
        gram.addmm_(flat.T, flat)
        batch_inputs.append((x, gram))

    hooks = [
        module.register_forward_hook(functools.partial(accumulate, name=name))
        for name, module in linears.items()
    ]
    try:
        for hidden, kwargs in inputs:
            layer(hidden, **kwargs)
            batch_inputs.clear()
    finally:
        for hook in hooks:
            hook.remove()
    return grams


def _hidden_of(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def shared_input_groups(grams: dict[str, torch.Tensor]) -> list[list[str]]:
    """Names grouped by shared Gram tensor (``layerwise`` shares it between linears with one input)."""
    groups: list[list[str]] = []
    for name, gram in grams.items():
        for group in groups:
            if grams[group[0]] is gram:
                group.append(name)
                break
        else:
            groups.append([name])
    return groups
