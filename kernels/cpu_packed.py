"""Weight-only int8/int4 linears in the packed CPU layouts torch has fast matmuls for.

One definition for both CPU consumers of our pack-quantized checkpoints: the embedded worker's static decoder
(``service/worker/local/decoder.py``) and our vLLM quantization method on vLLM's CPU backend
(``vllm_ops.py``). Both unpack the checkpoint's int32 words once at load time and then run:

- int8, one symmetric scale per output row (per channel): the int8 values [N, K] and the scales [N] as they
  are, run by ``torch._weight_int8pack_mm`` (a quarter of the bf16 bytes read per decode step);
- int4, symmetric or not, in groups of 32/64/128/256 that divide K, N a multiple of 16: the values in torch's
  CPU int4 layout (``_convert_weight_to_int4pack_for_cpu``: unsigned u = q + 8, two a byte) and a [G, N, 2]
  table of (scale, offset) per group, run by ``_weight_int4pack_mm_for_cpu``, which computes
  w = (u - 8) * scale + offset. Our (q - z) * s is that with scale = s and offset = -z * s.

Everything else (group-wise or asymmetric int8, other int4 groups or widths) has no torch CPU op:
:func:`packed_linear` returns None and the caller decides (dequantize once, or the reference per call). Both
ops are plain aten ops on plain tensors, so torch.compile traces them (dynamic row counts included), which
it does not through a prepacked ScriptObject.
"""

from __future__ import annotations

import torch

INT4_GROUPS = (32, 64, 128, 256)  # what torch's CPU int4 matmul takes
INT4_ROWS = 16  # its packing takes N in blocks of 16 ("expect N to be dividable by 16")


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ (q * scale[:, None]).T for int8 q [N, K] and one scale a row [N]; in x's dtype."""
    y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), q, scale.to(x.dtype))
    return y.view(*x.shape[:-1], q.shape[0])


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed int4 values [N, K] (any int dtype, K even) -> torch's CPU int4 layout, uint8 [N, K / 2]."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32) + 8, 1)


def int4_scale_zero(scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """Our scales [N, G] and signed zero points [N, G] (None: symmetric) -> the [G, N, 2] float32 table of
    (scale, -zero * scale) that ``_weight_int4pack_mm_for_cpu`` takes (cast it to the activations' dtype)."""
    offset = torch.zeros_like(scale, dtype=torch.float32) if zero is None else -zero.float() * scale.float()
    return torch.stack([scale.float(), offset], dim=-1).transpose(0, 1).contiguous()


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group: int, out_features: int
) -> torch.Tensor:
    """x [..., K] @ W.T for W in torch's CPU int4 layout (:func:`pack_int4`, :func:`int4_scale_zero` in x's
    dtype); in x's dtype."""
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), packed, group, scale_zero)
    return y.view(*x.shape[:-1], out_features)


class Int8Linear:
    """Per-output-channel symmetric int8 weights kept as int8 [N, K], run by :func:`int8_matmul`."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.q, self.scale, self.bias = q.contiguous(), scale.contiguous(), bias
        self.out_features = q.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_matmul(x, self.q, self.scale)
        return y + self.bias if self.bias is not None else y


class Int4Linear:
    """Group-wise int4 weights in torch's CPU int4 layout, run by :func:`int4_matmul`; the (scale, offset)
    table is cast to each activation dtype once and kept."""

    def __init__(
        self,
        q: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        group: int,
        bias: torch.Tensor | None,
    ) -> None:
        self.packed = pack_int4(q)
        self.scale_zero = int4_scale_zero(scale, zero)  # [G, N, 2]
        self.group, self.bias, self.out_features = group, bias, q.shape[0]
        self._cast: dict[torch.dtype, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        sz = self._cast.get(x.dtype)
        if sz is None:
            sz = self._cast[x.dtype] = self.scale_zero.to(x.dtype)
        y = int4_matmul(x, self.packed, sz, self.group, self.out_features)
        return y + self.bias if self.bias is not None else y


def packed_linear(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> Int8Linear | Int4Linear | None:
    """The packed CPU linear for signed values q [N, K], scales [N, G] and signed zero points [N, G] (None:
    symmetric), or None when torch has no CPU op for the format (see the module doc). ``group_size`` is the
    group width (K for per channel)."""
    k = q.shape[1]
    if bits == 8 and scale.shape[1] == 1 and zero is None:
        return Int8Linear(q, scale[:, 0], bias)
    if bits == 4 and group_size in INT4_GROUPS and k % group_size == 0 and q.shape[0] % INT4_ROWS == 0:
        return Int4Linear(q, scale, zero, group_size, bias)
    return None
