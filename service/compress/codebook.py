"""Weight sharing: every weight takes one of 2^bits values of its output row's codebook (or its row's and
group's), non-uniform, as in SqueezeLLM and Deep Compression.

Codebooks are fitted by k-means on the row's (group's) weights, each weight counted with the importance of
its input channel, ``H[k, k]`` (``H = X^T X`` of the calibration inputs): the output error of a per-weight
perturbation ``d`` is ``d^T H d``, whose diagonal part ``sum_k H[k, k] d_k^2`` is what weighted k-means
minimises (SqueezeLLM uses the Fisher diagonal to the same end). Lloyd's iterations, in one dimension:
assign each weight to the nearest value (sorted codebook, bucketed by midpoints), move each value to the
weighted mean of its weights; initialised at the row's importance-weighted quantiles. Values are rounded to
float16 (the checkpoint dtype) before the final assignment.

``kmeans``: weights take their nearest codebook value. ``gptq``: the codebooks are fixed first, then GPTQ's
column sweep (``gptq.sweep``) rounds each column to the nearest value of every row's codebook and spreads
the error over the columns not yet rounded, by decreasing ``H[k, k]`` under ``actorder`` (free here:
codebooks are fixed up front, so the order changes nothing in the format).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from squeezeserve.kernels import codebook_layout
from squeezeserve.service.compress.calibration import layerwise, shared_input_groups
from squeezeserve.service.compress.gptq import SWEEP, inverse_hessian_factor, one_thread, sweep
from squeezeserve.service.compress.options import CompressOptions
from squeezeserve.service.compress.quantize import relative_error

# Lloyd iterations (they stop early when nothing moves); each is cheap (see weighted_kmeans).
KMEANS_ITERATIONS = 50


@dataclass
class CodebookWeight:
    """Indices and codebooks of one weight ``[out, in]``."""

    indices: torch.Tensor  # int64 [out, in], 0 .. 2^bits - 1
    codebook: torch.Tensor  # float16 [out, groups * 2^bits], each group's values sorted
    bits: int
    group_size: int | None

    def rows(self, start: int, stop: int) -> CodebookWeight:
        return CodebookWeight(self.indices[start:stop], self.codebook[start:stop], self.bits, self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        groups = codebook_layout.groups_for(self.indices.shape[1], self.group_size)
        index = self.indices + _group_offsets(self.indices.shape[1], groups, self.bits, self.indices.device)
        return torch.gather(self.codebook.to(dtype), 1, index)


def _group_offsets(in_features: int, groups: int, bits: int, device: torch.device) -> torch.Tensor:
    """[in]: where column k's group starts in a row's codebook (``(k // G) * 2^bits``)."""
    return (torch.arange(in_features, device=device) // (in_features // groups)) << bits


def nearest(values: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of each row's sorted ``codebook`` [R, E] for ``values`` [R, C]."""
    midpoints = (codebook[:, 1:] + codebook[:, :-1]) / 2
    return torch.searchsorted(midpoints.contiguous(), values.contiguous())


def weighted_kmeans(
    values: torch.Tensor, importance: torch.Tensor, entries: int, iterations: int = KMEANS_ITERATIONS
) -> torch.Tensor:
    """Sorted float16-representable codebooks [R, entries] for ``values`` [R, C] under weights
    ``importance`` [R, C] (see the module docstring).

    In one dimension a cluster is a run of the sorted values: with each row sorted once and prefix sums of
    ``w`` and ``w v`` along it, an iteration finds the runs' ends by searching the E - 1 midpoints (not
    every value) and takes each run's weighted mean from two prefix sums: O(R E log C), not O(R C). An
    entry left with no values splits the run with the largest weighted squared error (a third prefix sum)."""
    rows, cols = values.shape
    weights = importance.clamp(min=0) + 1e-12  # a dead channel still places its weight, barely
    ordered, order = values.sort(dim=1)
    sorted_weights = weights.gather(1, order).to(torch.float64)
    zero = torch.zeros(rows, 1, dtype=torch.float64, device=values.device)
    mass_before = torch.cat([zero, sorted_weights.cumsum(dim=1)], dim=1)  # [R, C + 1]
    moment_before = torch.cat([zero, (sorted_weights * ordered).cumsum(dim=1)], dim=1)
    square_before = torch.cat([zero, (sorted_weights * ordered.double().square()).cumsum(dim=1)], dim=1)
    # Start at the weighted quantiles: entries where the importance mass is (plain quantiles leave entries
    # on unimportant tails, where Lloyd's iterations cannot move them away).
    targets = (torch.arange(entries, device=values.device) + 0.5) / entries * mass_before[:, -1:]
    positions = torch.searchsorted(mass_before[:, 1:].contiguous(), targets.contiguous()).clamp(max=cols - 1)
    codebook = ordered.gather(1, positions)
    first, last = zero.long(), torch.full((rows, 1), cols, device=values.device)
    ordered = ordered.contiguous()
    for _ in range(iterations):
        # Value v belongs to entry e when midpoint e-1 < v <= midpoint e (``nearest``'s rule).
        midpoints = ((codebook[:, 1:] + codebook[:, :-1]) / 2).contiguous()
        edges = torch.cat([first, torch.searchsorted(ordered, midpoints, right=True), last], dim=1)
        mass = mass_before.gather(1, edges[:, 1:]) - mass_before.gather(1, edges[:, :-1])
        moment = moment_before.gather(1, edges[:, 1:]) - moment_before.gather(1, edges[:, :-1])
        updated = torch.where(mass > 0, moment / mass.clamp(min=1e-300), codebook.double()).float()
        empty = mass <= 0
        if empty.any():
            # An entry no value chose (duplicate starts where values repeat) splits the cluster with the most
            # weighted squared error instead: it moves to that cluster's largest value.
            square = square_before.gather(1, edges[:, 1:]) - square_before.gather(1, edges[:, :-1])
            error = torch.where(empty, 0.0, square - moment.square() / mass.clamp(min=1e-300))
            worst = error.argsort(dim=1, descending=True)
            nth_empty = (empty.cumsum(dim=1) - 1).clamp(min=0)
            largest = (edges[:, 1:] - 1).clamp(min=0).gather(1, worst.gather(1, nth_empty))
            updated = torch.where(empty, ordered.gather(1, largest), updated)
        updated = updated.sort(dim=1).values
        if torch.equal(updated, codebook):
            break
        codebook = updated
    return codebook.to(torch.float16).to(torch.float32).sort(dim=1).values


def fit_codebooks(
    weight: torch.Tensor, importance: torch.Tensor, bits: int, group_size: int | None
) -> torch.Tensor:
    """float32 codebooks [out, groups * 2^bits] (float16 values) for ``weight`` [out, in] given the input
    channels' ``importance`` [in]."""
    out, in_features = weight.shape
    groups = codebook_layout.groups_for(in_features, group_size)
    width = in_features // groups
    grouped = weight.to(torch.float32).reshape(out * groups, width)
    weights = importance.to(torch.float32).view(groups, width).repeat(out, 1)
    return weighted_kmeans(grouped, weights, codebook_layout.entries(bits)).reshape(out, -1)


def codebook_quantize(
    weight: torch.Tensor,
    gram: torch.Tensor,
    bits: int,
    group_size: int | None,
    algorithm: str,
    damp: float = 0.01,
    actorder: bool = True,
    block_size: int = 128,
) -> CodebookWeight:
    """Weight-share ``weight`` [out, in] given its inputs' Gram matrix ``gram`` [in, in] (``algorithm``
    kmeans or gptq; see the module docstring)."""
    out, in_features = weight.shape
    if gram.shape != (in_features, in_features):
        raise ValueError(f"gram must be [{in_features}, {in_features}], got {tuple(gram.shape)}")
    if algorithm not in ("kmeans", "gptq"):
        raise ValueError(f"codebooks are fitted by kmeans or gptq, not {algorithm}")
    gram = gram.to(device=weight.device, dtype=torch.float32)
    importance = torch.diag(gram)
    codebook = fit_codebooks(weight, importance, bits, group_size)
    groups = codebook_layout.groups_for(in_features, group_size)
    entries = codebook_layout.entries(bits)
    per_group = codebook.view(out, groups, entries)
    width = in_features // groups
    if algorithm == "kmeans":
        values = weight.to(torch.float32).view(out, groups, width)
        indices = torch.stack([nearest(values[:, g], per_group[:, g]) for g in range(groups)], dim=1)
        return CodebookWeight(indices.view(out, in_features), codebook.to(torch.float16), bits, group_size)
    with one_thread():
        indices = _gptq_onto(weight, gram, per_group, width, damp, actorder, block_size)
    return CodebookWeight(indices, codebook.to(torch.float16), bits, group_size)


def _gptq_onto(
    weight: torch.Tensor,
    gram: torch.Tensor,
    per_group: torch.Tensor,
    width: int,
    damp: float,
    actorder: bool,
    block_size: int,
) -> torch.Tensor:
    """GPTQ's sweep rounding each column onto the fixed codebooks ``per_group`` [out, groups, E]; returns
    the indices [out, in]."""
    wt = weight.detach().to(torch.float32).t().contiguous()  # [in, out]
    in_features = wt.shape[0]
    wt[torch.diag(gram) == 0] = 0.0
    order = torch.arange(in_features, device=wt.device)
    if actorder:
        order = torch.argsort(torch.diag(gram), descending=True, stable=True)
        wt, gram = wt[order], gram[order][:, order]
    group_of = (order // width).tolist()
    u, _ = inverse_hessian_factor(gram, damp)
    indices = torch.empty(in_features, wt.shape[1], dtype=torch.long, device=wt.device)
    rows = torch.arange(wt.shape[1], device=wt.device)

    def round_column(j: int, column: torch.Tensor) -> torch.Tensor:
        codebook = per_group[:, group_of[j]]
        index = nearest(column[:, None], codebook)[:, 0]
        indices[j] = index
        return codebook[rows, index]

    sweep(wt, u, round_column, max(SWEEP, block_size // SWEEP * SWEEP), SWEEP)
    if actorder:
        indices = torch.empty_like(indices).index_copy_(0, order, indices)
    return indices.t().contiguous()


def share_weights(
    model: nn.Module, input_ids: torch.Tensor, options: CompressOptions
) -> tuple[dict[str, CodebookWeight], dict[str, float]]:
    """``--method codebook``: every decoder Linear weight-shared, layer by layer on the calibration inputs
    (``layerwise``: later layers calibrate on what the compressed earlier ones compute). Linears reading the
    same input (q/k/v, gate/up) share one Gram matrix and are swept as one stacked matrix (rows are
    independent given H). Returns each Linear's indices and codebooks and its relative error."""
    assert options.bits is not None
    shared: dict[str, CodebookWeight] = {}
    errors: dict[str, float] = {}

    def share_layer(_index: int, linears: dict[str, nn.Linear], grams: dict[str, torch.Tensor]) -> None:
        for names in shared_input_groups(grams):
            weight = torch.cat([linears[n].weight.data for n in names])
            stacked = codebook_quantize(
                weight, grams[names[0]], options.bits, options.group_size, options.algorithm,
                damp=options.damp, actorder=options.actorder,
            )  # fmt: skip
            start = 0
            for n in names:
                module = linears[n]
                shared[n] = stacked.rows(start, start + module.out_features)
                start += module.out_features
                dequantized = shared[n].dequantize()
                errors[n] = relative_error(module.weight.data, dequantized)
                module.weight.data = dequantized.to(module.weight.dtype)

    layerwise(model, input_ids, share_layer, desc=f"codebook {options.bits}-bit ({options.algorithm})")
    return shared, errors
