"""What a compressed checkpoint holds, read from its config.json: the one place serving code (the embedded
worker's loader, our vLLM quantization method) and the compressor agree on the weight schemes.

``squeezeserve compress`` writes compressed-tensors' ``quantization_config`` (``service/compress/formats.py``
builds it); :func:`read_quantization` parses it back without compressed-tensors and refuses what nothing
here serves. The packed bit layout itself lives in ``quant_layout.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

PACK_QUANTIZED = "pack-quantized"
FLOAT_QUANTIZED = "float-quantized"


@dataclass(frozen=True)
class QuantScheme:
    """How one weight is quantized: integer (``bits``) or fp8, per channel or per group."""

    kind: Literal["int", "float"]
    bits: int
    group_size: int | None  # None: one scale per output channel
    symmetric: bool
    scale_dtype: torch.dtype = torch.float16

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def groups_for(self, in_features: int) -> int:
        return 1 if self.group_size is None else in_features // self.group_size

    def group_width(self, in_features: int) -> int:
        return in_features if self.group_size is None else self.group_size

    def check_shape(self, name: str, in_features: int) -> None:
        if self.group_size is not None and in_features % self.group_size:
            raise ValueError(
                f"group size {self.group_size} does not divide the input width {in_features} of {name}; "
                f"choose a group size that divides every layer's input width"
            )


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's quantization as the loader needs it (parsed without compressed-tensors)."""

    scheme: QuantScheme
    ignore: tuple[str, ...]


def read_quantization(config: dict[str, Any]) -> CheckpointQuant:
    """Parse the ``quantization_config`` that ``quantization_config`` writes; refuse anything else."""
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "compressed-tensors":
        raise ValueError(
            f"unsupported quant_method {quant.get('quant_method')!r}: expected compressed-tensors"
        )
    groups = list((quant.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"expected one compressed-tensors config group, found {len(groups)}")
    weights = groups[0].get("weights") or {}
    fmt = groups[0].get("format") or quant.get("format")
    if fmt not in (PACK_QUANTIZED, FLOAT_QUANTIZED):
        raise ValueError(f"unsupported compressed-tensors format {fmt!r}")
    strategy = weights.get("strategy")
    if strategy not in ("channel", "group"):
        raise ValueError(f"unsupported weight strategy {strategy!r}: expected channel or group")
    if weights.get("actorder") in ("group", "dynamic"):
        raise ValueError("actorder 'group' checkpoints need a g_idx permutation, which we do not read")
    if groups[0].get("input_activations") and fmt == PACK_QUANTIZED:
        raise ValueError(
            "the checkpoint quantizes activations too; only weight-only integer schemes are read"
        )
    kind = weights.get("type", "int")
    scheme = QuantScheme(
        kind=kind,
        bits=int(weights["num_bits"]),
        group_size=int(weights["group_size"]) if strategy == "group" else None,
        symmetric=bool(weights.get("symmetric", True)),
        scale_dtype=torch.float32 if kind == "float" else torch.float16,
    )
    return CheckpointQuant(scheme=scheme, ignore=tuple(quant.get("ignore") or ()))
