"""GPTQ (Frantar et al., 2022): quantize a weight column by column, correcting the columns not yet
quantized for each column's rounding error, weighted by the inverse Hessian of the layer's inputs.

For a Linear with inputs ``X`` (one row per token), the loss ``||X W^T - X Q^T||^2`` has Hessian
``H = 2 X^T X`` (the scale does not matter here). With ``U`` the upper Cholesky factor of ``H^-1``
(damped: ``H + λ mean(diag H) I``), quantizing column ``j`` to ``q_j`` and applying

    e = (w_j - q_j) / U[j, j]          W[:, j+1:] -= e ⊗ U[j, j+1:]

is the optimal update of the remaining columns. Columns are processed in blocks (lazy batch updates).
Group scales and zero points are taken from the *updated* weights when a group starts (min/max, as in
RTN). With a pruning ``mask`` the pruned entries are forced to 0 (exactly representable) and their
error is spread like any other rounding error (SparseGPT's compensation, mask fixed in advance); kept
entries never round to 0, so the sparsity pattern survives quantization exactly.
"""

from __future__ import annotations

import torch

from squeezeserve.service.compress.quantize import (
    QuantizedWeight,
    QuantScheme,
    compute_qparams,
    dequantize_codes,
    package,
    quantize_with,
)


def keep_nonzero(
    codes: torch.Tensor, weight: torch.Tensor, zero: torch.Tensor | None, keep: torch.Tensor
) -> torch.Tensor:
    """Move kept entries whose code decodes to 0 one step towards their weight's sign."""
    zero_code = torch.zeros_like(codes) if zero is None else zero.expand_as(codes)
    collapsed = keep & (codes == zero_code)
    step = torch.where(weight >= 0, 1.0, -1.0)
    return torch.where(collapsed, zero_code + step, codes)


def apply_mask(
    codes: torch.Tensor,
    weight: torch.Tensor,
    zero: torch.Tensor | None,
    mask: torch.Tensor | None,
    scheme: QuantScheme,
) -> torch.Tensor:
    """Pruned entries (``mask`` False) get the code of 0; kept entries a nonzero code (int schemes)."""
    if mask is None:
        return codes
    zero_code = torch.zeros_like(codes) if zero is None else zero.expand_as(codes)
    codes = torch.where(mask, codes, zero_code)
    codes = keep_nonzero(codes, weight, zero, mask)
    return codes.clamp(scheme.qmin, scheme.qmax)


def gptq_quantize(
    weight: torch.Tensor,
    gram: torch.Tensor,
    scheme: QuantScheme,
    mask: torch.Tensor | None = None,
    damp: float = 0.01,
    block_size: int = 128,
) -> QuantizedWeight:
    """GPTQ-quantize ``weight`` ``[out, in]`` given its inputs' Gram matrix ``gram`` ``[in, in]``."""
    if scheme.kind != "int":
        raise ValueError("GPTQ applies to integer schemes only")
    out, in_features = weight.shape
    w = weight.detach().to(torch.float32).clone()
    h = gram.to(torch.float32).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(in_features)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    width = scheme.group_width(in_features)
    groups = in_features // width
    if scheme.group_size is not None:
        block_size = max(width, block_size // width * width)
    codes = torch.zeros(out, in_features)
    scales = torch.zeros(out, groups)
    zeros = torch.zeros(out, groups) if not scheme.symmetric else None
    if scheme.group_size is None:
        scale, zero = compute_qparams(w.amin(dim=1), w.amax(dim=1), scheme)
        scales[:, 0] = scale
        if zeros is not None:
            zeros[:, 0] = zero

    for b0 in range(0, in_features, block_size):
        b1 = min(b0 + block_size, in_features)
        block = w[:, b0:b1].clone()
        errors = torch.zeros_like(block)
        u_block = u[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            g = col // width
            if scheme.group_size is not None and col % width == 0:
                chunk = block[:, i : i + width]
                scale, zero = compute_qparams(chunk.amin(dim=1), chunk.amax(dim=1), scheme)
                scales[:, g] = scale
                if zeros is not None:
                    zeros[:, g] = zero
            s = scales[:, g : g + 1]
            z = None if zeros is None else zeros[:, g : g + 1]
            column = block[:, i : i + 1]
            q = quantize_with(column, s, z, scheme)
            q = apply_mask(q, column, z, None if mask is None else mask[:, col : col + 1], scheme)
            codes[:, col : col + 1] = q
            error = (column - dequantize_codes(q, s, z)) / u_block[i, i]
            block[:, i:] -= error @ u_block[i : i + 1, i:]
            errors[:, i : i + 1] = error
        w[:, b1:] -= errors @ u[b0:b1, b1:]
    return package(codes, scales, zeros, scheme)
