"""The compressed-tensors checkpoint format, as vLLM 0.26.0 (compressed-tensors 0.17.0) reads it.

One ``config_groups`` entry targets every ``Linear`` except ``lm_head`` (tied to the embedding in the
bundled model, and vLLM keeps the LM head unquantized). Per quantized linear ``<name>``:

    int (format "pack-quantized", W4A16 / W8A16, vLLM scheme CompressedTensorsWNA16)
        <name>.weight_packed      int32 [out, ceil(in * bits / 32)]   codes + 2^(bits-1), packed along `in`
        <name>.weight_scale       float16 [out, in / group]           (channel: [out, 1])
        <name>.weight_zero_point  int32 [ceil(out * bits / 32), in / group]  asymmetric, packed along `out`
        <name>.weight_shape       int64 [2] = (out, in)
    fp8 (format "float-quantized", W8A8 dynamic per token on H100, vLLM scheme CompressedTensorsW8A8Fp8)
        <name>.weight             float8_e4m3fn [out, in]
        <name>.weight_scale       float32 [out, 1]

The bit layout of ``weight_packed`` is defined once, in ``squeezeserve.kernels.quant_layout`` (our
kernels read it); a test checks it against compressed-tensors' own ``pack_to_int32``. Low-rank factors and
codebooks are our own formats (``squeezeserve.kernels.checkpoint_format`` builds their
``quantization_config``; ``codebook_layout`` defines the index packing).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from squeezeserve.kernels.checkpoint_format import FLOAT_QUANTIZED, IGNORED, PACK_QUANTIZED
from squeezeserve.kernels.codebook_layout import pack_indices
from squeezeserve.kernels.quant_layout import pack_int32
from squeezeserve.service.compress.codebook import CodebookWeight
from squeezeserve.service.compress.quantize import QuantizedWeight, QuantScheme

# Files of the source checkpoint that are weights or our own records: never copied into the output.
NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
NOT_COPIED_NAMES = {"model.safetensors.index.json", "pytorch_model.bin.index.json", "squeeze-baseline.json"}


def scheme_format(scheme: QuantScheme) -> str:
    return FLOAT_QUANTIZED if scheme.kind == "float" else PACK_QUANTIZED


def quantization_config(scheme: QuantScheme, actorder: bool = False) -> dict[str, Any]:
    """The ``quantization_config`` block of config.json, built with compressed-tensors' own schema.

    ``actorder``: GPTQ swept the columns in activation order with static groups, recorded as
    compressed-tensors' ``actorder: "weight"`` (group strategy only; the tensors are the same as without it,
    no ``g_idx``: vLLM 0.26's CompressedTensorsWNA16 adds a g_idx parameter only for ``"group"``)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=scheme.bits,
        type=scheme.kind,
        symmetric=scheme.symmetric,
        strategy="channel" if scheme.group_size is None else "group",
        group_size=scheme.group_size,
        observer="minmax",
        actorder="weight" if actorder and scheme.group_size is not None else None,
    )
    inputs = None
    if scheme.kind == "float":
        # Dynamic per-token FP8 activations: vLLM computes their scales at run time (W8A8 on H100).
        inputs = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
    config = QuantizationConfig(
        config_groups={
            "group_0": QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
        },
        format=scheme_format(scheme),
        ignore=list(IGNORED),
        quantization_status="compressed",
    )
    return config.model_dump(mode="json")


def compressed_tensors_for(name: str, quantized: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The checkpoint tensors that replace ``<name>.weight``."""
    scheme = quantized.scheme
    if scheme.kind == "float":
        return {
            f"{name}.weight": quantized.codes.contiguous(),
            f"{name}.weight_scale": quantized.scale.to(torch.float32).contiguous(),
        }
    out, in_features = quantized.codes.shape
    tensors = {
        f"{name}.weight_packed": pack_int32(quantized.codes, scheme.bits).contiguous(),
        f"{name}.weight_scale": quantized.scale.contiguous(),
        f"{name}.weight_shape": torch.tensor([out, in_features], dtype=torch.int64),
    }
    if quantized.zero_point is not None:
        tensors[f"{name}.weight_zero_point"] = pack_int32(quantized.zero_point, scheme.bits, packed_dim=0)
    return tensors


def lowrank_tensors_for(
    name: str, u: torch.Tensor, v: torch.Tensor, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors that replace ``<name>.weight`` by its factors (``checkpoint_format``)."""
    return {f"{name}.weight_u": u.to(dtype).contiguous(), f"{name}.weight_v": v.to(dtype).contiguous()}


def codebook_tensors_for(name: str, shared: CodebookWeight) -> dict[str, torch.Tensor]:
    """The checkpoint tensors that replace ``<name>.weight`` by indices and codebooks."""
    out, in_features = shared.indices.shape
    return {
        f"{name}.weight_indices": pack_indices(shared.indices, shared.bits).contiguous(),
        f"{name}.weight_codebook": shared.codebook.to(torch.float16).contiguous(),
        f"{name}.weight_shape": torch.tensor([out, in_features], dtype=torch.int64),
    }


def copy_side_files(source: Path, out: Path) -> list[str]:
    """Copy tokenizer, generation config and other non-weight files of ``source`` into ``out``."""
    copied = []
    for item in sorted(source.iterdir()):
        if not item.is_file() or item.name in NOT_COPIED_NAMES or item.name == "config.json":
            continue
        if item.name.endswith(NOT_COPIED_SUFFIXES) or item.name.startswith("."):
            continue
        shutil.copy2(item, out / item.name)
        copied.append(item.name)
    return copied


def write_config(source: Path, out: Path, quant_config: dict[str, Any] | None) -> dict[str, Any]:
    """config.json of ``source`` with ``quantization_config`` set (or removed when ``None``)."""
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config
