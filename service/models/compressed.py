"""Load a checkpoint written by ``squeezeserve compress`` (compressed-tensors) into a transformers model.
Serving code: it reads the format through ``squeezeserve.kernels.checkpoint_format``, never the compressor.

``squeezeserve.service.models.loader.load_model`` calls ``load_compressed_model`` for any checkpoint whose
config.json has a ``quantization_config``. Integer (pack-quantized) Linears become
``squeezeserve.kernels.modules.QuantLinear`` holding the packed checkpoint tensors as they are; their
forward is our ``quant_matmul`` op (on CPU its reference: dequantize, then matmul). FP8 weights are
dequantized on load (CPUs have no FP8 matmul). Everything else loads as in a dense checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from squeezeserve.kernels.checkpoint_format import read_quantization

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

    from squeezeserve.kernels.modules import QuantLinear

    path = Path(path)
    scheme = read_quantization(json.loads((path / "config.json").read_text())).scheme
    hf_config = AutoConfig.from_pretrained(path)
    # Without this transformers would hand the checkpoint to its own compressed-tensors integration.
    if hasattr(hf_config, "quantization_config"):
        del hf_config.quantization_config
    tensors = read_tensors(path)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    names = sorted({key.rsplit(".", 1)[0] for key in tensors if key.endswith(".weight_scale")})
    state: dict[str, torch.Tensor] = {}
    for name in names:
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(
                f"{path}: {name} is quantized in the checkpoint but is not a Linear in the model"
            )
        if scheme.kind == "float":  # per-channel fp8: CPUs have no fp8 matmul, so expand once
            fp8, scale = tensors.pop(f"{name}.weight"), tensors.pop(f"{name}.weight_scale")
            state[f"{name}.weight"] = (fp8.to(torch.float32) * scale.to(torch.float32)).to(dtype)
            continue
        quant = QuantLinear(
            linear.in_features,
            linear.out_features,
            bits=scheme.bits,
            group_size=scheme.group_size or linear.in_features,
            symmetric=scheme.symmetric,
            bias=linear.bias is not None,
            dtype=dtype,
        )
        quant.load_packed({s: tensors.pop(f"{name}.{s}") for s in QUANT_SUFFIXES if f"{name}.{s}" in tensors})
        if linear.bias is not None:
            quant.bias.data.copy_(tensors.pop(f"{name}.bias"))
        _set_module(model, name, quant)
    state.update({k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    quant_buffers = {f"{n}.{s}" for n in names for s in (*QUANT_SUFFIXES, "bias")}
    tied = {"lm_head.weight"} if getattr(hf_config, "tie_word_embeddings", False) else set()
    missing = [key for key in missing if key not in tied and key not in quant_buffers]
    if missing or unexpected:
        raise ValueError(
            f"{path}: checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.tie_weights()
    return model.to(device).eval()
