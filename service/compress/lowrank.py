"""Low-rank factorization: every decoder Linear's weight W [N, K] becomes U [N, r] V [r, K], with the ranks
chosen per layer to meet one parameter budget.

``svd``: the truncated SVD of W itself, the best rank-r approximation in Frobenius norm, which treats every
input channel alike. ``asvd`` (activation-aware, after ASVD, Yuan et al. 2023): the error that matters is
the layer's output error ``||X (W - W')^T||``, and input channels with large activations weigh more. With
``S = diag(s)``, ``s_j = rms_j(X)^ALPHA`` (``rms_j``: root mean square of input channel j over the
calibration tokens), the SVD is taken of ``W S`` and the factors are

    W S ~ A_r diag(σ_r) B_r^T      U = A_r diag(σ_r)^(1/2)      V = diag(σ_r)^(1/2) B_r^T S^-1

so errors land on channels where the activations are small. ``svdllm`` (SVD-LLM, Wang et al. 2024) whitens
with the Cholesky factor ``L`` of the damped ``H = X^T X / n`` instead of a diagonal (``H + λ mean(diag H) I
= L L^T``): the SVD is taken of ``W L`` and ``V = diag(σ_r)^(1/2) B_r^T L^-1``. Then the output error is
exactly the truncated energy, ``||X (W - U V)^T||_F^2 = n Σ_{i>r} σ_i²``: truncation-aware, where the
diagonal only approximates it. On the bundled model (0.9 of the parameters, 32 x 256 calibration tokens,
1024-token slice) svdllm 1.78x the baseline's perplexity, asvd 22x, svd 1176x (README).

Ranks: a rank-r factor costs ``r (N + K)`` parameters. Each singular value of each layer is a candidate
whose value is its share of that layer's energy, ``σ_i² / Σ σ²`` (the relative output error it removes),
and whose cost is ``N + K``; the candidates are taken by value per parameter, best first, until the budget
``rank_ratio x Σ N K`` is spent (every layer gets at least rank 1). A layer whose rank reaches
``N K / (N + K)``, where the factors are as large as W, stays dense.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from squeezeserve.service.compress.calibration import Calibration
from squeezeserve.service.compress.quantize import relative_error

log = logging.getLogger(__name__)

# ASVD's exponent on the activation statistics (its paper's best on Llama; 1 over-weights outlier channels).
ALPHA = 0.5
# svdllm: damping of H before its Cholesky factorisation, a fraction of its mean diagonal (as GPTQ's): a few
# hundred calibration tokens leave the 1536-wide down_proj inputs' H rank-deficient.
WHITEN_DAMP = 0.01
ALGORITHMS = ("svdllm", "asvd", "svd")


@dataclass
class Factorization:
    """What ``factorize`` did: the factored Linears' factors (float32), every Linear's rank (None: dense)."""

    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ranks: dict[str, int | None]
    errors: dict[str, float]  # ||W - U V||_F / ||W||_F (dense: 0)
    parameters: dict[str, int]  # before / after, decoder Linears only


@torch.no_grad()
def input_covariances(
    model: nn.Module, linears: dict[str, nn.Linear], input_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``H = X^T X / n`` (float32) of every Linear in ``linears`` over the calibration tokens, in one pass of
    the unmodified model. Linears fed the very same tensor (q/k/v, gate/up) share one matrix."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    seen: list[tuple[torch.Tensor, str]] = []  # (input, the Linear that owns its sum) in this batch

    def accumulate(_module: nn.Module, args: tuple, _out: torch.Tensor, name: str) -> None:
        for tensor, owner in seen:
            if tensor is args[0]:
                sums.setdefault(name, sums[owner])
                counts[name] = counts[owner]
                return
        flat = args[0].reshape(-1, args[0].shape[-1]).to(torch.float32)
        gram = sums.setdefault(name, torch.zeros(flat.shape[1], flat.shape[1], device=flat.device))
        gram.addmm_(flat.T, flat)
        counts[name] = counts.get(name, 0) + flat.shape[0]
        seen.append((args[0], name))

    hooks = [m.register_forward_hook(functools.partial(accumulate, name=n)) for n, m in linears.items()]
    try:
        for start in range(0, input_ids.shape[0], 8):
            model(input_ids=input_ids[start : start + 8].to(model.device), use_cache=False)
            seen.clear()
    finally:
        for hook in hooks:
            hook.remove()
    scaled: dict[int, torch.Tensor] = {}  # shared sums stay shared
    return {name: scaled.setdefault(id(sums[name]), sums[name] / max(counts[name], 1)) for name in linears}


def whitening(covariance: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor ``L`` of ``H + WHITEN_DAMP mean(diag H) I`` (float32)."""
    h = covariance.to(torch.float64)
    mean = float(torch.diag(h).mean()) or 1.0
    h = h + WHITEN_DAMP * mean * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    return torch.linalg.cholesky(h).to(torch.float32)


def input_scaling(rms: torch.Tensor) -> torch.Tensor:
    """``s = rms^ALPHA``, channels that never fire lifted to the smallest live one (S must be invertible)."""
    s = rms.pow(ALPHA)
    live = s[s > 0]
    return s.clamp(min=float(live.min()) if live.numel() else 1.0)


def max_useful_rank(n: int, k: int) -> int:
    """The rank at which U and V hold as many parameters as W."""
    return n * k // (n + k)


def allocate_ranks(spectra: dict[str, tuple[torch.Tensor, int, int]], ratio: float) -> dict[str, int | None]:
    """Ranks meeting ``ratio x Σ N K`` parameters (see the module docstring); ``spectra`` maps a name to
    (singular values, N, K). None: the layer stays dense."""
    budget = ratio * sum(n * k for _, n, k in spectra.values())
    ranks = dict.fromkeys(spectra, 1)
    spent = sum(n + k for _, n, k in spectra.values())
    candidates = []
    for name, (sigma, n, k) in spectra.items():
        energy = sigma.double().square()
        share = (energy / energy.sum().clamp(min=1e-30)).tolist()
        cap = max_useful_rank(n, k)
        for i in range(1, min(cap, len(share))):
            # Rank i + 1 = cap makes the layer dense: the last step costs what is left up to N K.
            cost = n * k - i * (n + k) if i + 1 == cap else n + k
            candidates.append((share[i] / cost, name, cost))
    for _value, name, cost in sorted(candidates, key=lambda c: -c[0]):
        if spent + cost > budget:
            continue  # a cheaper layer's next value may still fit (this layer's next ones cost as much)
        ranks[name] += 1
        spent += cost
    dense = {name for name, (_, n, k) in spectra.items() if ranks[name] >= max_useful_rank(n, k)}
    return {name: None if name in dense else rank for name, rank in ranks.items()}


def _decompose(
    weight: torch.Tensor, algorithm: str, covariance: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor] | None]:
    """(A, σ, B^T, unscale): the SVD of W, W S or W L; ``unscale`` maps rows of B^T back to input space."""
    if algorithm == "svd" or covariance is None:
        a, sigma, bt = torch.linalg.svd(weight, full_matrices=False)
        return a, sigma, bt, None
    if algorithm == "asvd":
        scale = input_scaling(torch.diag(covariance).clamp(min=0).sqrt())
        a, sigma, bt = torch.linalg.svd(weight * scale, full_matrices=False)
        return a, sigma, bt, lambda rows: rows / scale
    lower = whitening(covariance)
    a, sigma, bt = torch.linalg.svd(weight @ lower, full_matrices=False)
    return a, sigma, bt, lambda rows: torch.linalg.solve_triangular(lower, rows, upper=False, left=False)


@torch.no_grad()
def factorize(
    linears: dict[str, nn.Linear],
    ratio: float,
    algorithm: str = "svd",
    covariances: dict[str, torch.Tensor] | None = None,
) -> Factorization:
    """Factor ``linears`` (their weights replaced in place by ``U V``) to ``ratio`` of their parameters by
    ``algorithm`` (svd, asvd, svdllm; the last two need the inputs' ``covariances``)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"low-rank factorization runs {', '.join(ALGORITHMS)}, not {algorithm}")
    if algorithm != "svd" and covariances is None:
        raise ValueError(f"{algorithm} needs the calibration inputs' covariances")
    decompositions = {}
    for name, module in tqdm(linears.items(), desc=f"SVD ({algorithm})", unit="linear"):
        weight = module.weight.to(torch.float32)
        covariance = None if covariances is None else covariances[name].to(weight.device)
        decompositions[name] = _decompose(weight, algorithm, covariance)
    spectra = {name: (d[1], *linears[name].weight.shape) for name, d in decompositions.items()}
    ranks = allocate_ranks(spectra, ratio)
    factors, errors = {}, {}
    for name, rank in ranks.items():
        if rank is None:
            errors[name] = 0.0
            continue
        a, sigma, bt, unscale = decompositions.pop(name)
        root = sigma[:rank].sqrt()
        u = a[:, :rank] * root
        v = root[:, None] * bt[:rank]
        if unscale is not None:
            v = unscale(v)
        weight = linears[name].weight
        approx = u @ v
        errors[name] = relative_error(weight, approx)
        weight.data = approx.to(weight.dtype)  # later steps (the layer report) see what the checkpoint holds
        factors[name] = (u, v)
    before = sum(m.in_features * m.out_features for m in linears.values())
    after = sum(
        m.in_features * m.out_features if ranks[n] is None else ranks[n] * (m.in_features + m.out_features)
        for n, m in linears.items()
    )
    log.info(
        "low-rank: %d of %d linears factored, parameters %d -> %d", len(factors), len(linears), before, after
    )
    return Factorization(factors, ranks, errors, {"before": before, "after": after})


def lowrank(
    model: nn.Module,
    linears: dict[str, nn.Linear],
    ratio: float,
    algorithm: str,
    calibration: Calibration | None,
) -> Factorization:
    """``--method lowrank --algorithm svdllm|asvd|svd``."""
    covariances = None
    if algorithm != "svd":
        if calibration is None:
            raise ValueError(f"{algorithm} needs calibration text for its activation statistics")
        covariances = input_covariances(model, linears, calibration.input_ids)
    return factorize(linears, ratio, algorithm, covariances)
