"""The one definition of squeezeserve's weight-sharing layout (``quantization_config.format: codebook``).

Each output row ``n`` of a weight W [N, K] (out_features, in_features) has, per group of G input columns
(``group_size`` None: one group as wide as K, "per channel"), a codebook of E = 2**bits shared values; a
weight is stored as the index of its value:

``weight_indices``   int32 [N, ceil(K / P)], P = 32 // bits indices per word (8 at 4 bits; 10 at 3 bits, the
                     top 2 bits unused), packed along K, lowest bits first: index k of a row sits in word
                     k // P at bit offset bits * (k % P); a row's last word is zero-padded.
``weight_codebook``  float16 [N, groups * E]: row n's codebook of group g is columns g * E .. g * E + E - 1.
``weight_shape``     int64 [2] = (N, K).

Dequantization: ``W[n, k] = codebook[n, (k // G) * E + index[n, k]]`` (G = K per channel). At 4 bits per
channel that is 4 bits a weight plus 2 * 16 bytes a row (K = 576: 4.44 bits a weight; int4 g32 with fp16
scales and packed zero points: 4.625). Plain torch (no triton): the compressor imports it cheaply.
"""

from __future__ import annotations

import math

import torch

from squeezeserve.kernels.quant_layout import pack_unsigned, unpack_unsigned

BITS = (3, 4)


def check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"codebook bits must be one of {BITS}, got {bits}")


def indices_per_word(bits: int) -> int:
    check_bits(bits)
    return 32 // bits


def entries(bits: int) -> int:
    check_bits(bits)
    return 1 << bits


def groups_for(in_features: int, group_size: int | None) -> int:
    """Codebooks per row: 1 per channel, else K / G (G must divide K)."""
    if group_size is None:
        return 1
    if group_size < 1 or in_features % group_size:
        raise ValueError(f"codebook group size {group_size} must divide the input width {in_features}")
    return in_features // group_size


def pack_indices(indices: torch.Tensor, bits: int) -> torch.Tensor:
    """Indices [N, K] in 0 .. 2**bits - 1 -> ``weight_indices`` int32 [N, ceil(K / P)]."""
    if indices.dim() != 2:
        raise ValueError(f"pack_indices expects [out, in] indices, got shape {tuple(indices.shape)}")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= entries(bits)):
        raise ValueError(f"{bits}-bit codebook indices must lie in 0..{entries(bits) - 1}")
    return pack_unsigned(indices, bits)


def unpack_indices(words: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """``weight_indices`` -> int64 indices [N, in_features]."""
    if words.dtype != torch.int32:
        raise ValueError(f"codebook indices are int32 words, got {words.dtype}")
    if words.shape[1] != math.ceil(in_features / indices_per_word(bits)):
        raise ValueError(
            f"{words.shape[1]} index words a row cannot hold K={in_features} at {bits} bits "
            f"({math.ceil(in_features / indices_per_word(bits))} needed)"
        )
    return unpack_unsigned(words, bits, in_features).long()


def dequantize(
    words: torch.Tensor, codebook: torch.Tensor, in_features: int, group_size: int | None, bits: int
) -> torch.Tensor:
    """The dense weight [N, K] in ``codebook.dtype``: each index replaced by its row's (group's) value."""
    index = unpack_indices(words, bits, in_features)
    groups = groups_for(in_features, group_size)
    if tuple(codebook.shape) != (words.shape[0], groups * entries(bits)):
        raise ValueError(
            f"codebook must be [{words.shape[0]}, {groups * entries(bits)}] ({groups} groups of "
            f"{entries(bits)} values), got {tuple(codebook.shape)}"
        )
    if group_size is not None:
        index = index + (torch.arange(in_features, device=index.device) // group_size) * entries(bits)
    return torch.gather(codebook, 1, index)
