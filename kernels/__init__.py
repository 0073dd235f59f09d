"""squeezeserve's own kernels: Triton kernels registered as ``torch.ops.squeezeserve.*``.

Importing this package is cheap: it imports neither torch nor triton. The functional API
(``squeezeserve.kernels.rmsnorm(...)`` and friends) and the modules load on first attribute access,
which also registers the ops. On CPU tensors every op runs its plain-PyTorch reference
(``kernels/reference.py``); on CUDA tensors it runs the Triton kernel.

Open ``kernels/registry.py`` first: it says how an op is registered and dispatched.
"""

from __future__ import annotations

import importlib
from typing import Any

_FUNCTIONAL = (
    "swiglu",
    "silu_and_mul",
    "swiglu_oai",
    "rmsnorm",
    "add_rmsnorm",
    "softmax",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "quant_matmul",
    "codebook_matmul",
)
_MODULES = ("RMSNorm", "SwiGLUMLP", "QuantLinear", "LowRankLinear", "CodebookLinear")

__all__ = [*_FUNCTIONAL, *_MODULES]


def __getattr__(name: str) -> Any:
    if name in _FUNCTIONAL:
        return getattr(importlib.import_module("squeezeserve.kernels.functional"), name)
    if name in _MODULES:
        return getattr(importlib.import_module("squeezeserve.kernels.modules"), name)
    raise AttributeError(f"module 'squeezeserve.kernels' has no attribute {name!r}")
