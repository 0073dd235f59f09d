"""The one definition of squeezeserve's weight-only quantized layout: compressed-tensors ``pack-quantized``.

This is exactly what compressed-tensors 0.17.0 writes (and vLLM 0.26.0 loads) for a Linear with
``format: pack-quantized``, integer weights of ``num_bits`` in {4, 8} and group-wise strategy. For a
weight W of shape [N, K] (out_features, in_features) and group size G:

``weight_packed``      int32 [N, ceil(K / P)], P = 32 // bits values per int32 (8 for int4, 4 for int8),
                       packed along K (the input dim). Value k of a row sits in word k // P at bit offset
                       bits * (k % P): lowest bits first. Each value is stored offset-binary:
                       ``stored = q + 2**(bits-1)`` with signed q in [-2**(bits-1), 2**(bits-1) - 1]
                       (int4: q in [-8, 7] stored as 0..15). A row's last word is zero-padded.
``weight_scale``       [N, ceil(K / G)], float (fp16/bf16 as the model), one scale per group of G inputs.
``weight_zero_point``  asymmetric only: signed zero points [N, ceil(K / G)] packed the same way but along
                       N (the output dim): int32 [ceil(N / P), ceil(K / G)]. Symmetric: absent (zero).
``weight_shape``       int64 [2] = (N, K).

Dequantization, in the scale dtype exactly as compressed-tensors does it:
``W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]``. The offsets cancel, so a kernel may use
``stored_q - stored_zero`` (or ``stored_q - 2**(bits-1)`` when symmetric).

Quantization (round-to-nearest, compressed-tensors' ``calculate_qparams``): the group's range is widened
to include 0; symmetric ``scale = max|w| / ((qmax - qmin) / 2)``, asymmetric ``scale = (max - min) /
(qmax - qmin)``, ``zero = clamp(round(qmin - min / scale), qmin, qmax)``; ``q = clamp(round(w / scale +
zero), qmin, qmax)``.

Everything here is plain torch (no triton), so the compressor can import it cheaply.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_BITS = (4, 8)


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")


def pack_factor(bits: int) -> int:
    """Values per int32 word."""
    _check_bits(bits)
    return 32 // bits


def pack_unsigned(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ints below 2**bits (int32 [rows, cols]) into int32 words along dim 1: ``32 // bits`` a
    word, value c at bit offset ``bits * (c % per_word)`` of word ``c // per_word``; the last word of a row is
    zero-padded. Shared by the pack-quantized layout and the codebook indices (3 bits: 10 a word)."""
    per_word = 32 // bits
    rows, cols = values.shape
    padded = math.ceil(cols / per_word) * per_word
    values = torch.nn.functional.pad(values.to(torch.int32), (0, padded - cols))
    shifts = torch.arange(per_word, dtype=torch.int32, device=values.device) * bits
    # int32 arithmetic wraps like the hardware does, so the top value of an 8-bit word may set the sign bit.
    return (values.view(rows, padded // per_word, per_word) << shifts).sum(dim=2, dtype=torch.int32)


def unpack_unsigned(words: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`pack_unsigned`: int32 words [rows, W] -> int32 values [rows, cols] (no padding)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32, device=words.device) * bits
    values = (words[:, :, None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(words.shape[0], -1)[:, :cols]


def pack_int32(values: torch.Tensor, bits: int, packed_dim: int = 1) -> torch.Tensor:
    """Pack signed ints (int8 [rows, cols]) into int32 words along ``packed_dim``, lowest bits first."""
    if values.dtype != torch.int8 or values.dim() != 2:
        raise ValueError(
            f"pack_int32 expects a 2-D int8 tensor, got {values.dtype} of shape {tuple(values.shape)}"
        )
    if packed_dim not in (0, 1):
        raise ValueError(f"packed_dim must be 0 or 1, got {packed_dim}")
    _check_bits(bits)
    unsigned = values.to(torch.int32) + (1 << (bits - 1))
    packed = pack_unsigned(unsigned.t() if packed_dim == 0 else unsigned, bits)
    return packed.t().contiguous() if packed_dim == 0 else packed


def unpack_int32(
    packed: torch.Tensor, bits: int, shape: tuple[int, int], packed_dim: int = 1
) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: int32 words -> signed int8 values of ``shape`` (padding dropped)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"unpack_int32 expects int32 words, got {packed.dtype}")
    _check_bits(bits)
    words = packed.t() if packed_dim == 0 else packed
    rows, cols = (shape[1], shape[0]) if packed_dim == 0 else shape
    values = unpack_unsigned(words[:rows], bits, cols) - (1 << (bits - 1))
    if packed_dim == 0:
        values = values.t()
    return values.to(torch.int8).contiguous()


def quantize(
    weight: torch.Tensor, bits: int, group_size: int, symmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest group-wise quantization of ``weight`` [N, K].

    Returns (q int8 [N, K], scale [N, ceil(K/G)] in weight's dtype, zero int8 [N, ceil(K/G)] or None).
    """
    _check_bits(bits)
    if weight.dim() != 2:
        raise ValueError(f"quantize expects a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")
    n_out, k_in = weight.shape
    n_groups = math.ceil(k_in / group_size)
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    w = weight.float()
    padded = torch.nn.functional.pad(w, (0, n_groups * group_size - k_in)).view(n_out, n_groups, group_size)
    # Padding zeros cannot change the statistics: the range is widened to include 0 anyway.
    w_min = padded.amin(-1).clamp(max=0)
    w_max = padded.amax(-1).clamp(min=0)
    if symmetric:
        scale = torch.maximum(w_min.abs(), w_max) / ((qmax - qmin) / 2)
    else:
        scale = (w_max - w_min) / (qmax - qmin)
    scale = scale.to(weight.dtype)
    tiny = torch.finfo(weight.dtype).eps
    scale = torch.where(scale == 0, torch.tensor(tiny, dtype=weight.dtype, device=weight.device), scale)
    scale_f = scale.float()
    zero = None if symmetric else torch.clamp(torch.round(qmin - w_min / scale_f), qmin, qmax)
    expanded_scale = scale_f.repeat_interleave(group_size, dim=1)[:, :k_in]
    shifted = w / expanded_scale
    if zero is not None:
        shifted = shifted + zero.repeat_interleave(group_size, dim=1)[:, :k_in]
    q = torch.clamp(torch.round(shifted), qmin, qmax).to(torch.int8)
    return q, scale, None if zero is None else zero.to(torch.int8)


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    shape: tuple[int, int],
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """Packed layout -> dense weight [N, K] in ``scales.dtype``: (q - zero) * scale (compressed-tensors)."""
    n_out, k_in = shape
    q = unpack_int32(qweight, bits, (n_out, k_in))
    expand = lambda t: t.repeat_interleave(group_size, dim=1)[:, :k_in]  # noqa: E731
    values = q.to(scales.dtype)
    if zeros is not None:
        zero = unpack_int32(zeros, bits, (n_out, scales.shape[1]), packed_dim=0)
        values = values - expand(zero).to(scales.dtype)
    return values * expand(scales)


def pack_weight(
    weight: torch.Tensor, bits: int, group_size: int, symmetric: bool = True
) -> dict[str, torch.Tensor]:
    """Quantize and pack ``weight`` [N, K] into compressed-tensors' tensors, keyed by their checkpoint names
    (prefix them with the module name, e.g. ``model.layers.0.mlp.down_proj.weight_packed``)."""
    q, scale, zero = quantize(weight, bits, group_size, symmetric)
    tensors = {
        "weight_packed": pack_int32(q, bits),
        "weight_scale": scale,
        "weight_shape": torch.tensor(weight.shape, dtype=torch.int64),
    }
    if zero is not None:
        tensors["weight_zero_point"] = pack_int32(zero, bits, packed_dim=0)
    return tensors


# --- thread-owned word order: an int4 layout of the Hopper decode's own, made at load ----------------------
#
# In every 32-deep block of a row (four words), word p holds the value pairs that lane p % 4 of a wgmma
# register operand's fragment takes from the block: K values 8 i + 2 p in nibble i < 4 and 8 (i - 4) + 2 p + 1
# in nibble i >= 4, so that pair j is nibbles j and j + 4 (one shift and one mask-and-bias lop3 place it as
# a bf16x2 / f16x2 register) and each thread reads only its own words. Measured 4-11% off the Gluon decode's
# loop on the H100 (tests/gpu/decode_stream_probe.py; tests/benchmarks/NOTES.md, nineteenth session).
OWNED_BLOCK = 32  # K values a block


def _owned_source(device: torch.device) -> torch.Tensor:
    """[32]: for nibble i of word p of an owned block (index 8 p + i), the K offset in the block it holds."""
    lane, nibble = torch.arange(4).unsqueeze(1), torch.arange(8).unsqueeze(0)
    source = torch.where(nibble < 4, 8 * nibble + 2 * lane, 8 * (nibble - 4) + 2 * lane + 1)
    return source.flatten().to(device)


def to_owned_order(qweight: torch.Tensor) -> torch.Tensor:
    """int4 ``weight_packed`` [N, K / 8] (K a multiple of 32) in the thread-owned word order, same shape."""
    n, words = qweight.shape
    if words % 4:
        raise ValueError(f"to_owned_order: K must be a multiple of {OWNED_BLOCK}, got {words * 8}")
    values = unpack_unsigned(qweight, 4, words * 8).view(n, words // 4, OWNED_BLOCK)
    owned = values[:, :, _owned_source(qweight.device)]
    return pack_unsigned(owned.reshape(n, words * 8), 4)


def from_owned_order(owned: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_owned_order`: thread-owned words back to ``weight_packed``'s order."""
    n, words = owned.shape
    if words % 4:
        raise ValueError(f"from_owned_order: K must be a multiple of {OWNED_BLOCK}, got {words * 8}")
    values = unpack_unsigned(owned, 4, words * 8).view(n, words // 4, OWNED_BLOCK)
    standard = torch.empty_like(values)
    standard[:, :, _owned_source(owned.device)] = values
    return pack_unsigned(standard.reshape(n, words * 8), 4)


# --- the owned weights' zero points: a row's groups in one word, made at load -------------------------------
#
# ``weight_zero_point`` packs eight output rows' zero points of one group into a word, so a Hopper decode
# thread that holds two rows of a 256-deep g32 tile loads 16 words and uses a nibble of each: the registers
# that made it spill. The owned weights' zero points put eight consecutive groups of one row in a word:
# nibble i of word j of row n is the zero point of group 8 j + i (the last word zero-padded), stored as in
# ``weight_zero_point`` (offset-binary). A tile's zero points of a row are then one load (H100: 1.00-1.07x
# at g32, tests/benchmarks/NOTES.md, twenty-second session).


def to_owned_zeros(zeros: torch.Tensor, n: int) -> torch.Tensor:
    """int4 ``weight_zero_point`` [ceil(N / 8), groups] -> int32 [N, ceil(groups / 8)]."""
    if zeros.dtype != torch.int32 or zeros.dim() != 2 or zeros.shape[0] != math.ceil(n / 8):
        raise ValueError(
            f"to_owned_zeros: int4 zero points of {n} rows, got {zeros.dtype} {tuple(zeros.shape)}"
        )
    values = unpack_unsigned(zeros.t().contiguous(), 4, n).t()  # [N, groups]
    return pack_unsigned(values.contiguous(), 4)


def from_owned_zeros(owned: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of :func:`to_owned_zeros`: int32 [N, ceil(groups / 8)] -> [ceil(N / 8), groups]."""
    if owned.dtype != torch.int32 or owned.dim() != 2 or owned.shape[1] != math.ceil(groups / 8):
        raise ValueError(
            f"from_owned_zeros: int4 zero points of {groups} groups, got {owned.dtype} {tuple(owned.shape)}"
        )
    values = unpack_unsigned(owned, 4, groups)  # [N, groups]
    return pack_unsigned(values.t().contiguous(), 4).t().contiguous()
