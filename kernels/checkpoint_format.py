"""What a compressed checkpoint holds, read from its config.json: the one place serving code (the embedded
worker's loader, our vLLM quantization method) and the compressor agree on the weight schemes.

``squeezeserve compress`` writes compressed-tensors' ``quantization_config`` for integer and fp8 weights
(``service/compress/formats.py`` builds it); :func:`read_quantization` parses it back without
compressed-tensors and refuses what nothing here serves. The packed bit layout lives in ``quant_layout.py``.

Low-rank factors and codebooks have no compressed-tensors format: their ``quantization_config`` has
``quant_method: "squeezeserve"`` (the name our vLLM plugin registers, so vLLM hands such a checkpoint to it)
and is built and read here (:func:`lowrank_config`, :func:`codebook_config`). :func:`read_format` is the entry
every loader calls: it returns what the checkpoint holds, whichever of the three it is.

    low-rank   {"quant_method": "squeezeserve", "format": "low-rank", "ranks": {"<linear>": r, ...},
                "ignore": ["lm_head"]}
               <linear>.weight_u [out, r] and <linear>.weight_v [r, in] (checkpoint dtype) replace
               <linear>.weight: W = U V. Linears not in ``ranks`` keep a dense ``weight`` (a rank at which the
               factors are as large as W would not pay).
    codebook   {"quant_method": "squeezeserve", "format": "codebook", "bits": 3|4, "group_size": G|null,
                "ignore": ["lm_head"]}
               <linear>.weight_indices, .weight_codebook, .weight_shape (layout: ``codebook_layout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

PACK_QUANTIZED = "pack-quantized"
FLOAT_QUANTIZED = "float-quantized"
SQUEEZESERVE = "squeezeserve"  # quant_method of our own formats; the vLLM plugin's registered method name
LOW_RANK = "low-rank"
CODEBOOK = "codebook"
IGNORED = ("lm_head",)  # tied to the embedding in the bundled model; vLLM keeps the LM head unquantized


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


@dataclass(frozen=True)
class LowRankFormat:
    """Factored Linears: ``ranks`` maps each factored Linear's full name to its rank."""

    ranks: dict[str, int]
    ignore: tuple[str, ...] = IGNORED


@dataclass(frozen=True)
class CodebookFormat:
    """Weight-shared Linears: 2**bits values per output row (``group_size`` None) or per row and group."""

    bits: int
    group_size: int | None
    ignore: tuple[str, ...] = IGNORED


CheckpointFormat = CheckpointQuant | LowRankFormat | CodebookFormat


def lowrank_config(ranks: dict[str, int]) -> dict[str, Any]:
    return {"quant_method": SQUEEZESERVE, "format": LOW_RANK, "ranks": dict(ranks), "ignore": list(IGNORED)}


def codebook_config(bits: int, group_size: int | None) -> dict[str, Any]:
    return {
        "quant_method": SQUEEZESERVE,
        "format": CODEBOOK,
        "bits": bits,
        "group_size": group_size,
        "ignore": list(IGNORED),
    }


def read_format(config: dict[str, Any]) -> CheckpointFormat:
    """What the checkpoint whose config.json is ``config`` holds (see the module docstring); refuses what
    nothing here serves, saying why."""
    from squeezeserve.kernels import codebook_layout

    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != SQUEEZESERVE:
        return read_quantization(config)
    fmt = quant.get("format")
    ignore = tuple(quant.get("ignore") or ())
    if fmt == LOW_RANK:
        ranks = quant.get("ranks")
        if not isinstance(ranks, dict) or not all(isinstance(r, int) and r > 0 for r in ranks.values()):
            raise ValueError(
                f"a low-rank quantization_config needs ranks {{linear: positive int}}, got {ranks!r}"
            )
        return LowRankFormat(ranks=dict(ranks), ignore=ignore)
    if fmt == CODEBOOK:
        bits, group = quant.get("bits"), quant.get("group_size")
        codebook_layout.check_bits(bits)
        if group is not None and (not isinstance(group, int) or group < 16 or group % 16):
            raise ValueError(f"codebook group_size must be null or a multiple of 16, got {group!r}")
        return CodebookFormat(bits=bits, group_size=group, ignore=ignore)
    raise ValueError(f"unknown squeezeserve format {fmt!r}: expected {LOW_RANK!r} or {CODEBOOK!r}")
