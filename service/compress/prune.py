"""Pruning masks: unstructured (a fraction of each output row) or semi-structured N:M (2:4).

Scores decide what stays: magnitude ``|W_ij|``, or Wanda (Sun et al., 2023) ``|W_ij| * ||X_j||_2`` with
``||X_j||_2 = sqrt((X^T X)_jj)`` over the calibration tokens. Like Wanda, unstructured pruning compares
weights within each output row (every row keeps the same count), and N:M keeps the ``n`` best of each
``m`` consecutive input columns. A mask is True where the weight is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from squeezeserve.service.compress.options import PRUNE_METHODS


@dataclass(frozen=True)
class Sparsity:
    """``fraction`` of weights removed; ``n``:``m`` when semi-structured (``n`` kept of every ``m``)."""

    fraction: float
    n: int | None = None
    m: int | None = None

    @property
    def structured(self) -> bool:
        return self.m is not None

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.structured else f"{self.fraction:g}"


def parse_sparsity(text: str) -> Sparsity:
    """``"0.5"`` (unstructured fraction in (0, 1)) or ``"2:4"`` (n kept of every m, 0 < n < m)."""
    if ":" in text:
        n_text, m_text = text.split(":", 1)
        try:
            n, m = int(n_text), int(m_text)
        except ValueError:
            raise ValueError(f"sparsity {text!r}: N:M needs two integers, e.g. 2:4") from None
        if not 0 < n < m:
            raise ValueError(f"sparsity {text!r}: N:M needs 0 < N < M")
        return Sparsity(fraction=1 - n / m, n=n, m=m)
    try:
        fraction = float(text)
    except ValueError:
        raise ValueError(f"sparsity {text!r}: give a fraction such as 0.5 or a pattern such as 2:4") from None
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"sparsity {text!r}: the fraction must be between 0 and 1 (exclusive)")
    return Sparsity(fraction=fraction)


def prune_scores(weight: torch.Tensor, method: str, gram: torch.Tensor | None = None) -> torch.Tensor:
    scores = weight.detach().abs().to(torch.float32)
    if method == "magnitude":
        return scores
    if method == "wanda":
        if gram is None:
            raise ValueError("Wanda needs calibration inputs")
        return scores * torch.sqrt(torch.diag(gram).clamp(min=0)).unsqueeze(0)
    raise ValueError(f"unknown prune method {method!r}: choose one of {', '.join(PRUNE_METHODS)}")


def prune_mask(scores: torch.Tensor, sparsity: Sparsity) -> torch.Tensor:
    """Boolean keep-mask with the shape of ``scores`` ``[out, in]``."""
    out, in_features = scores.shape
    if sparsity.structured:
        m, n = sparsity.m, sparsity.n
        if in_features % m:
            raise ValueError(
                f"{n}:{m} sparsity needs the input width ({in_features}) to be a multiple of {m}"
            )
        grouped = scores.reshape(out, in_features // m, m)
        keep = torch.zeros_like(grouped, dtype=torch.bool)
        keep.scatter_(-1, grouped.topk(n, dim=-1).indices, True)
        return keep.reshape(out, in_features)
    pruned = int(in_features * sparsity.fraction)
    keep = torch.ones_like(scores, dtype=torch.bool)
    if pruned:
        keep.scatter_(1, scores.topk(pruned, dim=1, largest=False).indices, False)
    return keep


def enforce_mask(weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``weight`` with pruned entries 0 and kept entries nonzero in ``weight``'s dtype (a kept weight that
    rounds or trains to exactly 0 gets the dtype's smallest normal magnitude, so the pattern is exact)."""
    tiny = torch.finfo(weight.dtype).tiny
    kept = torch.where(weight == 0, torch.full_like(weight, tiny), weight)
    return torch.where(mask, kept, torch.zeros_like(weight))
