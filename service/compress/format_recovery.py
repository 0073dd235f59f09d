"""Recovery after low-rank factoring or weight sharing: the compressed format's own parameters train.

Pruning's recovery (``distill.py``) fine-tunes dense weights under a mask. A factored or weight-shared
Linear has no dense weight to train without leaving its format, so here the format's parameters are what
trains, by the same loop and loss (kd from the uncompressed source by default, or lm):

- low-rank, ``W = U V``: both factors train (``x -> (x V^T) U^T``), ranks fixed.
- codebook, ``W[n, k] = C[n, g(k) 2^bits + I[n, k]]``: the codebook values ``C`` train and the indices
  ``I`` stay (Deep Compression's centroid fine-tuning: a value's gradient is the sum of the gradients of
  the weights that share it, ``dL/dC[n, e] = sum_{k: I[n, k] = e} dL/dW[n, k]``, which ``torch.gather``'s
  backward computes). Indices chosen by GPTQ's error feedback are kept as they are; the trained values are
  rounded to float16, as the checkpoint stores them.

Everything else stays frozen (embeddings, norms, the LM head, Linears left dense by the rank budget), so
the checkpoint's format, shapes and size do not change.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from squeezeserve.kernels import codebook_layout
from squeezeserve.service.compress.calibration import Calibration
from squeezeserve.service.compress.codebook import CodebookWeight
from squeezeserve.service.compress.distill import fine_tune
from squeezeserve.service.compress.options import CompressOptions


class TrainableFactors(nn.Module):
    """A Linear computed as ``(x V^T) U^T``, with U [N, r] and V [r, K] trainable (float32)."""

    def __init__(self, u: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.u = nn.Parameter(u.detach().to(torch.float32).clone(), requires_grad=False)
        self.v = nn.Parameter(v.detach().to(torch.float32).clone(), requires_grad=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.v.to(x.dtype)), self.u.to(x.dtype), self.bias)

    def checkpoint_weight(self) -> torch.Tensor:
        return self.u @ self.v


class TrainableCodebook(nn.Module):
    """A Linear whose weight is gathered from trainable codebooks [out, groups * 2^bits] by fixed indices."""

    def __init__(self, shared: CodebookWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        out, in_features = shared.indices.shape
        self.codebook = nn.Parameter(shared.codebook.detach().to(torch.float32).clone(), requires_grad=False)
        # uint8 holds every index (at most 4 bits); gather's int64 is made per call (8x the bytes held).
        self.register_buffer("indices", shared.indices.to(torch.uint8), persistent=False)
        groups = codebook_layout.groups_for(in_features, shared.group_size)
        columns = torch.arange(in_features, device=shared.indices.device)
        starts = (columns // (in_features // groups)) << shared.bits  # where column k's group starts
        self.register_buffer("starts", starts, persistent=False)
        self.bits, self.group_size, self.bias = shared.bits, shared.group_size, bias

    def gathered_weight(self) -> torch.Tensor:
        return torch.gather(self.codebook, 1, self.indices.long() + self.starts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.gathered_weight().to(x.dtype), self.bias)

    def shared(self) -> CodebookWeight:
        """Indices and the trained codebooks, rounded to float16 as the checkpoint stores them."""
        codebook = self.codebook.detach().to(torch.float16)
        return CodebookWeight(self.indices.long(), codebook, self.bits, self.group_size)

    def checkpoint_weight(self) -> torch.Tensor:
        return self.shared().dequantize()


def recover_factors(
    lm: nn.Module,
    teacher: nn.Module | None,
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]],
    calibration: Calibration,
    options: CompressOptions,
) -> dict[str, Any]:
    """Train the low-rank ``factors`` (name -> (U, V)) in ``lm``; ``factors`` and the Linears' weights
    (``U V``) are updated in place. Returns what squeeze.json records."""
    modules = {name: TrainableFactors(u, v, lm.get_submodule(name).bias) for name, (u, v) in factors.items()}
    record = _train(lm, teacher, modules, calibration, options)
    for name, module in modules.items():
        factors[name] = (module.u.detach(), module.v.detach())
    return record


def recover_codebooks(
    lm: nn.Module,
    teacher: nn.Module | None,
    shared: dict[str, CodebookWeight],
    calibration: Calibration,
    options: CompressOptions,
) -> dict[str, Any]:
    """Train the codebook values of ``shared`` (name -> indices and codebooks) in ``lm``, indices fixed;
    ``shared`` and the Linears' weights are updated in place. Returns what squeeze.json records."""
    modules = {name: TrainableCodebook(q, lm.get_submodule(name).bias) for name, q in shared.items()}
    record = _train(lm, teacher, modules, calibration, options)
    for name, module in modules.items():
        shared[name] = module.shared()
    return record


def _train(
    lm: nn.Module,
    teacher: nn.Module | None,
    modules: dict[str, TrainableFactors | TrainableCodebook],
    calibration: Calibration,
    options: CompressOptions,
) -> dict[str, Any]:
    """Swap ``modules`` in for the Linears of the same names, fine-tune their parameters, and swap the
    Linears back with the trained weights (codebooks in the checkpoint's float16; factors' product in
    float32, as ``lowrank.factorize`` leaves it)."""
    linears = {name: lm.get_submodule(name) for name in modules}
    for name, module in modules.items():
        lm.set_submodule(name, module)
    params = [p for module in modules.values() for p in module.parameters() if p is not module.bias]
    start = time.perf_counter()
    try:
        losses = fine_tune(lm, teacher, params, calibration.input_ids, options)
    finally:
        for name, linear in linears.items():
            lm.set_submodule(name, linear)
    with torch.no_grad():
        for name, module in modules.items():
            linears[name].weight.data = module.checkpoint_weight().to(linears[name].weight.dtype)
    return {
        "loss": options.recover_loss,
        "trained": "low-rank factors"
        if any(isinstance(m, TrainableFactors) for m in modules.values())
        else "codebook values",
        "parameters": sum(p.numel() for p in params),
        "steps": len(losses),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "seconds": round(time.perf_counter() - start, 2),
    }
