"""Load a checkpoint written by ``squeezeserve compress`` (compressed-tensors) into a transformers model.
Serving code: it reads the format through ``squeezeserve.kernels.checkpoint_format``, never the compressor.

``squeezeserve.service.models.loader.load_model`` calls ``load_compressed_model`` for any checkpoint whose
config.json has a ``quantization_config`` (``checkpoint_format.read_format`` says which format). Integer
(pack-quantized) Linears become ``squeezeserve.kernels.modules.QuantLinear`` holding the packed checkpoint
tensors as they are; their forward is our ``quant_matmul`` op (on CPU its reference: dequantize, then
matmul). Low-rank Linears become ``LowRankLinear`` (two GEMMs), weight-shared ones ``CodebookLinear``
(``codebook_matmul``). FP8 weights are dequantized on load (CPUs have no FP8 matmul). Everything else loads
as in a dense checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from squeezeserve.kernels.checkpoint_format import (
    CheckpointFormat,
    CheckpointQuant,
    CodebookFormat,
    LowRankFormat,
    read_format,
)

QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def load_compressed_model(path: str | Path, dtype: torch.dtype = torch.float32, device: Any = "cpu") -> Any:
    """A transformers causal LM over the compressed checkpoint at ``path``, floating tensors in ``dtype``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    fmt = read_format(json.loads((path / "config.json").read_text()))
    hf_config = AutoConfig.from_pretrained(path)
    # Without this transformers would hand the checkpoint to its own compressed-tensors integration.
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config
    tensors = read_tensors(path)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    marker = f".{MARKERS[type(fmt)]}"
    names = sorted({key.removesuffix(marker) for key in tensors if key.endswith(marker)})
    state: dict[str, torch.Tensor] = {}
    for name in names:
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(
                f"{path}: {name} is compressed in the checkpoint but is not a Linear in the model"
            )
        if isinstance(fmt, CheckpointQuant) and fmt.scheme.kind == "float":
            # per-channel fp8: CPUs have no fp8 matmul, so expand once
            fp8, scale = tensors.pop(f"{name}.weight"), tensors.pop(f"{name}.weight_scale")
            state[f"{name}.weight"] = (fp8.to(torch.float32) * scale.to(torch.float32)).to(dtype)
            continue
        module = _compressed_linear(fmt, name, linear, tensors, dtype)
        if linear.bias is not None:
            module.bias.data.copy_(tensors.pop(f"{name}.bias"))
        _set_module(model, name, module)
    state.update({k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(hf_config, "tie_word_embeddings", False) else set()
    replaced = set(names) - {key.removesuffix(".weight") for key in state}  # fp8 layers load dense
    missing = [key for key in missing if key not in tied and key.rsplit(".", 1)[0] not in replaced]
    if missing or unexpected:
        raise ValueError(
            f"{path}: checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.tie_weights()
    return model.to(device).eval()


# The tensor that marks a Linear as compressed, per format.
MARKERS = {CheckpointQuant: "weight_scale", LowRankFormat: "weight_u", CodebookFormat: "weight_indices"}


def _compressed_linear(
    fmt: CheckpointFormat, name: str, linear: nn.Linear, tensors: dict[str, torch.Tensor], dtype: torch.dtype
) -> nn.Module:
    """The module serving ``name`` (``tensors``' entries for it popped): QuantLinear, LowRankLinear or
    CodebookLinear."""
    from squeezeserve.kernels.modules import CodebookLinear, LowRankLinear, QuantLinear

    bias = linear.bias is not None
    if isinstance(fmt, LowRankFormat):
        u, v = tensors.pop(f"{name}.weight_u"), tensors.pop(f"{name}.weight_v")
        if u.shape[0] != linear.out_features or v.shape[1] != linear.in_features or u.shape[1] != v.shape[0]:
            raise ValueError(
                f"{name}: factors {tuple(u.shape)} x {tuple(v.shape)} do not make a "
                f"[{linear.out_features}, {linear.in_features}] weight"
            )
        module = LowRankLinear(linear.in_features, linear.out_features, v.shape[0], bias=bias, dtype=dtype)
        module.weight_u.data.copy_(u)
        module.weight_v.data.copy_(v)
        return module
    if isinstance(fmt, CodebookFormat):
        module = CodebookLinear(
            linear.in_features, linear.out_features, fmt.bits, fmt.group_size, bias=bias, dtype=dtype
        )
        suffixes = ("weight_indices", "weight_codebook", "weight_shape")
        module.load_tensors({s: tensors.pop(f"{name}.{s}") for s in suffixes if f"{name}.{s}" in tensors})
        return module
    scheme = fmt.scheme
    module = QuantLinear(
        linear.in_features,
        linear.out_features,
        bits=scheme.bits,
        group_size=scheme.group_size or linear.in_features,
        symmetric=scheme.symmetric,
        bias=bias,
        dtype=dtype,
    )
    module.load_packed({s: tensors.pop(f"{name}.{s}") for s in QUANT_SUFFIXES if f"{name}.{s}" in tensors})
    return module
