"""Turn a checkpoint directory (or a Hugging Face id) into a ready-to-run module: the one loading seam.

Every worker loads models through ``load_model``. A plain checkpoint goes through transformers; one with a
compressed-tensors ``quantization_config`` (written by ``squeezeserve compress``) goes through
``squeezeserve.service.models.compressed``. Either way the result then runs on our ops
(``squeezeserve.kernels.hf.patch_model``), so the same kernels serve on a laptop and on a GPU.
"""

from __future__ import annotations

import json
import logging
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)

Dtype = Literal["auto", "float16", "bfloat16", "float32"]
DTYPES: tuple[str, ...] = typing.get_args(Dtype)
QuantizedLinear = Literal["auto", "kernel", "dequantize"]
QUANTIZED_LINEAR_MODES: tuple[str, ...] = typing.get_args(QuantizedLinear)


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel, eval mode, on `device`
    tokenizer: Any
    path: str
    dtype: Any  # torch.dtype
    device: Any  # torch.device
    load_seconds: float
    quantization: str | None = None
    patched_ops: dict[str, int] = field(default_factory=dict)

    @property
    def eos_token_ids(self) -> set[int]:
        """Every token that ends a sequence: the generation config's and the tokenizer's."""
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for source in (getattr(gen, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(t) for t in source)
        return ids

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)


def read_config(path: str | Path) -> dict:
    config = Path(path) / "config.json"
    if not config.is_file():
        return {}
    return json.loads(config.read_text())


def resolve_dtype(dtype: str, config: dict, device: Any) -> Any:
    """``auto`` keeps the checkpoint's dtype (float32 if it names none), except float16 on CPU.

    CPUs without native fp16 matrix units run float16 GEMMs through a slow path whose cost grows with
    every extra row (the README's CPU section has the figures), so batched decode and prefill would crawl.
    ``auto`` serves float16 checkpoints in bfloat16 on CPU; ask for ``float16`` to override.
    """
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if dtype != "auto":
        return getattr(torch, dtype)
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    resolved = getattr(torch, name, torch.float32)
    if resolved == torch.float16 and torch.device(device).type == "cpu":
        return torch.bfloat16
    return resolved


def load_model(
    path: str | Path,
    dtype: str = "auto",
    device: str = "cpu",
    use_custom_ops: bool = True,
    quantized_linear: str = "auto",
) -> LoadedModel:
    """Load ``path`` for inference: eval mode, no grad, on ``device``, optionally running on our ops.

    ``quantized_linear`` says how weight-only quantized Linears (integer and codebook) run: ``kernel`` keeps
    the packed weights and calls ``torch.ops.squeezeserve.quant_matmul`` / ``codebook_matmul`` (the Triton
    kernels on CUDA; on CPU their references, which expand the whole weight on every call); ``dequantize``
    expands them once at load into plain
    Linears; ``auto`` is ``kernel`` on CUDA and ``dequantize`` on CPU, where per-call dequantization makes
    decode several times slower than the dense baseline.
    """
    if quantized_linear not in QUANTIZED_LINEAR_MODES:
        raise ValueError(f"quantized_linear must be one of {', '.join(QUANTIZED_LINEAR_MODES)}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    source = str(path)
    if Path(source).exists() and not (Path(source) / "config.json").is_file():
        raise FileNotFoundError(f"{source} is not a model checkpoint: it has no config.json")
    config = read_config(source)
    torch_device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, config, torch_device)
    tokenizer = AutoTokenizer.from_pretrained(source)
    quant = config.get("quantization_config")
    if quant:
        from squeezeserve.service.models.compressed import load_compressed_model

        model = load_compressed_model(source, dtype=torch_dtype, device=torch_device)
        quantization = str(quant.get("quant_method") or quant.get("format") or "compressed")
        if quantized_linear == "dequantize" or (quantized_linear == "auto" and torch_device.type == "cpu"):
            expanded = dequantize_linears(model)
            quantization += f" (dequantized on load: {expanded} linears)"
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, low_cpu_mem_usage=True)
        quantization = None
    model.to(torch_device).eval()
    model.requires_grad_(False)
    patched: dict[str, int] = {}
    if use_custom_ops:
        from squeezeserve.kernels.hf import patch_model

        patched = patch_model(model)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        path=source,
        dtype=torch_dtype,
        device=torch_device,
        load_seconds=time.perf_counter() - start,
        quantization=quantization,
        patched_ops=patched,
    )
    log.info(
        "loaded %s (%s, %s%s) in %.1fs; our ops: %s",
        source,
        str(torch_dtype).removeprefix("torch."),
        torch_device,
        f", {quantization}" if quantization else "",
        loaded.load_seconds,
        patched or "none",
    )
    return loaded


def dequantize_linears(model: Any) -> int:
    """Replace every ``QuantLinear`` and ``CodebookLinear`` in ``model`` by a plain ``nn.Linear`` with its
    dequantized weight (``LowRankLinear`` stays: its two GEMMs are cheaper than the dense one)."""
    from torch import nn

    from squeezeserve.kernels.modules import CodebookLinear, QuantLinear

    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear | CodebookLinear):
                weight = child.dequantized_weight()
                dense = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                dense.to(device=weight.device, dtype=weight.dtype)
                dense.weight.data.copy_(weight)
                if child.bias is not None:
                    dense.bias.data.copy_(child.bias)
                setattr(parent, name, dense)
                count += 1
    return count
