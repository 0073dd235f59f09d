"""How every squeezeserve op is registered and dispatched.

Each op file in ``kernels/ops/`` defines its Triton kernels and one launcher, then registers the
launcher with ``torch.library.triton_op("squeezeserve::<name>")`` (launches go through
``wrap_triton``, so torch.compile sees the kernels). The launcher starts with :func:`use_reference`:

- CUDA tensors run the launcher (compiled Triton kernels).
- CPU tensors run the plain-PyTorch reference from ``kernels/reference.py`` -- the same op works on a
  laptop with no GPU, and the embedded CPU worker gets bit-for-bit Hugging Face numerics.
- Inside :func:`triton_on_cpu`, CPU tensors run the launcher instead, which only works with
  ``TRITON_INTERPRET=1`` set before the kernels were imported. That is how the tests exercise the Triton
  kernels on a machine without a GPU while production CPU calls take the fast reference.

:func:`load` imports every op file, registering all ops; ``torch.ops.squeezeserve.*`` exists after it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator

import torch

OP_MODULES = ("swiglu", "rmsnorm", "softmax", "cross_entropy", "fused_linear_ce", "quant_matmul")

_triton_on_cpu = False


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@contextlib.contextmanager
def triton_on_cpu(enabled: bool = True) -> Iterator[None]:
    """Route CPU tensors through the Triton launchers (under the interpreter) instead of the reference."""
    global _triton_on_cpu
    if enabled and not interpreting():
        raise RuntimeError(
            "triton_on_cpu() needs TRITON_INTERPRET=1 in the environment before squeezeserve.kernels.ops "
            "is imported; without it Triton cannot run kernels on CPU tensors"
        )
    previous, _triton_on_cpu = _triton_on_cpu, enabled
    try:
        yield
    finally:
        _triton_on_cpu = previous


def use_reference(tensor: torch.Tensor) -> bool:
    """True when an op body should run the plain-PyTorch reference for ``tensor``'s device.

    Every op body starts with this check rather than relying only on a CPU kernel registration, because
    under torch.compile (functionalization) a ``triton_op`` is decomposed into its body on every device.
    """
    return tensor.device.type != "cuda" and not _triton_on_cpu


def load() -> None:
    """Import every op file so that all ``torch.ops.squeezeserve.*`` ops are registered."""
    for name in OP_MODULES:
        importlib.import_module(f"squeezeserve.kernels.ops.{name}")
