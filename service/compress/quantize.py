"""Weight quantization schemes and round-to-nearest (RTN) quantization.

A scheme maps a weight ``W`` of shape ``[out, in]`` to codes ``q``, scales ``s`` and (asymmetric only)
integer zero points ``z``, one ``(s, z)`` per output row and group of ``group_size`` input columns
(``group_size=None``: one per row, "channel"). The arithmetic is compressed-tensors' (the library vLLM
loads these checkpoints with), so what we write dequantizes there exactly as it does here:

    range          [qmin, qmax] = [-2^(b-1), 2^(b-1) - 1]         (int4: [-8, 7]; int8: [-128, 127])
    min, max       per group, widened to include 0 (0.0 must stay exactly representable: pruned weights)
    symmetric      s = max(|min|, |max|) / ((qmax - qmin) / 2),   z = 0
    asymmetric     s = (max - min) / (qmax - qmin),               z = round(qmin - min / s)
    quantize       q = clamp(round(W / s + z), qmin, qmax)
    dequantize     W' = (q - z) * s

``s`` is rounded to the checkpoint's dtype (float16) *before* ``q`` is computed, because that rounded
value is what every loader multiplies by. ``search_qparams`` replaces min/max by the best of a grid of
scales ``r * s`` (and, asymmetric, the zero points next to min/max's) under an importance-weighted squared
error: with a weight dequantized from GGUF Q4_1 (``d * k + m``, float ``m``) min/max's zero point leaves the
whole group off its lattice by up to half a step, and a slightly different scale often fits it better.
FP8 (E4M3) is symmetric per channel: ``s = absmax / 448``, ``q = fp8(W / s)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from squeezeserve.kernels.checkpoint_format import QuantScheme

FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class QuantizedWeight:
    """Codes and parameters of one quantized weight ``[out, in]``."""

    codes: torch.Tensor  # int8 codes in [qmin, qmax] (int schemes) or float8_e4m3fn (fp8)
    scale: torch.Tensor  # [out, groups], scheme.scale_dtype
    zero_point: torch.Tensor | None  # [out, groups] int8 (asymmetric int only)
    scheme: QuantScheme

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """The quantized weight of output rows ``start:stop``."""
        zero = None if self.zero_point is None else self.zero_point[start:stop]
        return QuantizedWeight(self.codes[start:stop], self.scale[start:stop], zero, self.scheme)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, in_features = self.codes.shape
        width = self.scheme.group_width(in_features)
        codes = self.codes.to(torch.float32).view(out, -1, width)
        if self.zero_point is not None:
            codes = codes - self.zero_point.to(torch.float32).unsqueeze(-1)
        return (codes * self.scale.to(torch.float32).unsqueeze(-1)).view(out, in_features).to(dtype)


def compute_qparams(
    group_min: torch.Tensor, group_max: torch.Tensor, scheme: QuantScheme
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (rounded to ``scheme.scale_dtype``, returned as float32) and zero point per group."""
    group_min = torch.clamp(group_min, max=0.0)
    group_max = torch.clamp(group_max, min=0.0)
    if scheme.kind == "float":
        scale = torch.maximum(group_min.abs(), group_max) / FP8_MAX
        zero = None
    elif scheme.symmetric:
        scale = torch.maximum(group_min.abs(), group_max) / ((scheme.qmax - scheme.qmin) / 2)
        zero = None
    else:
        scale = (group_max - group_min) / (scheme.qmax - scheme.qmin)
    tiny = torch.finfo(scheme.scale_dtype).tiny
    scale = scale.clamp(min=tiny).to(scheme.scale_dtype).to(torch.float32)
    if scheme.kind == "int" and not scheme.symmetric:
        zero = torch.clamp(torch.round(scheme.qmin - group_min / scale), scheme.qmin, scheme.qmax)
    return scale, zero


# Scale ratios tried by search_qparams: on the bundled model's weights this narrow grid removed nearly as
# much of min/max's squared error as a denser, wider one with zero-point shifts, at a fraction of the cost.
SEARCH_RATIOS = tuple(round(0.85 + 0.01 * i, 2) for i in range(26))
SEARCH_ZERO_SHIFTS = (-1, 0, 1)


def search_qparams(
    grouped: torch.Tensor, scheme: QuantScheme, importance: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point per group of ``grouped`` ``[out, groups, width]`` minimising
    ``sum_i importance_i (w_i - W'_i)^2`` over ``SEARCH_RATIOS`` x ``SEARCH_ZERO_SHIFTS`` (``importance``
    ``[groups, width]``, e.g. the Hessian diagonal; None: plain squared error). Min/max's own parameters are
    a candidate (ratio 1, shift 0), so the result is never worse than ``compute_qparams``'s."""
    if scheme.kind != "int":
        raise ValueError("the scale search applies to integer schemes only")
    group_min = grouped.amin(dim=-1).clamp(max=0.0)
    group_max = grouped.amax(dim=-1).clamp(min=0.0)
    base, _ = compute_qparams(group_min, group_max, scheme)
    weights = None if importance is None else importance.to(grouped.dtype)
    best_error = torch.full_like(base, float("inf"))
    best_scale, best_zero = base.clone(), None if scheme.symmetric else torch.zeros_like(base)
    tiny = torch.finfo(scheme.scale_dtype).tiny
    for ratio in SEARCH_RATIOS:
        scale = (base * ratio).clamp(min=tiny).to(scheme.scale_dtype).to(torch.float32)
        steps = torch.round(grouped / scale.unsqueeze(-1))  # shared by every zero point: only the clamp moves
        natural = None if scheme.symmetric else torch.round(scheme.qmin - group_min / scale)
        for shift in (0,) if scheme.symmetric else SEARCH_ZERO_SHIFTS:
            zero = None if natural is None else (natural + shift).clamp(scheme.qmin, scheme.qmax)
            # (clamp(q + z, qmin, qmax) - z) * s == clamp(q, qmin - z, qmax - z) * s
            low, high = (
                (scheme.qmin, scheme.qmax) if zero is None else (scheme.qmin - zero, scheme.qmax - zero)
            )
            low = low if isinstance(low, int) else low.unsqueeze(-1)
            high = high if isinstance(high, int) else high.unsqueeze(-1)
            diff = steps.clamp(low, high).mul_(scale.unsqueeze(-1)).sub_(grouped).square_()
            error = (diff if weights is None else diff.mul_(weights)).sum(dim=-1)
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best_scale = torch.where(better, scale, best_scale)
            if zero is not None:
                best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def quantize_with(
    weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme
) -> torch.Tensor:
    """Codes of ``weight`` ``[out, k]`` under per-row ``scale``/``zero`` ``[out, 1]`` (or broadcastable)."""
    if scheme.kind == "float":
        return (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    codes = torch.round(weight / scale)
    if zero is not None:
        codes = codes + zero
    return codes.clamp(scheme.qmin, scheme.qmax)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    codes = codes.to(torch.float32)
    if zero is not None:
        codes = codes - zero
    return codes * scale


def quantize_rtn(weight: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Round-to-nearest quantization of ``weight`` ``[out, in]`` with min/max parameters per group."""
    out, in_features = weight.shape
    width = scheme.group_width(in_features)
    grouped = weight.detach().to(torch.float32).reshape(out, -1, width)
    scale, zero = compute_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), scheme)
    codes = quantize_with(grouped, scale.unsqueeze(-1), None if zero is None else zero.unsqueeze(-1), scheme)
    return package(codes.reshape(out, in_features), scale, zero, scheme)


def package(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme
) -> QuantizedWeight:
    """Store codes/parameters in their checkpoint dtypes."""
    if scheme.kind == "int":
        codes = codes.to(torch.int8)
    return QuantizedWeight(
        codes=codes,
        scale=scale.to(scheme.scale_dtype),
        zero_point=None if zero is None else zero.to(torch.int8),
        scheme=scheme,
    )


def relative_error(weight: torch.Tensor, approximation: torch.Tensor) -> float:
    """``||W - W'||_F / ||W||_F``."""
    weight = weight.to(torch.float32)
    return float(torch.linalg.norm(weight - approximation) / torch.linalg.norm(weight).clamp(min=1e-12))
