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

Eager calls through ``kernels/functional.py`` skip the dispatcher (:func:`eager`, :class:`EagerOp`): the
torch.library layers (custom-op dispatch, the Python autograd kernel, the backward op's second dispatch)
cost tens of microseconds of host time per call, more than the kernels at decode sizes. The fast path
runs the same op bodies and autograd formulas under one ``torch.autograd.Function``; anything that traces
(torch.compile, make_fx, fake or functional tensors, functorch transforms) goes through
``torch.ops.squeezeserve.*`` as before, so compiled graphs still see the registered ops.

:func:`load` imports every op file, registering all ops; ``torch.ops.squeezeserve.*`` exists after it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._library import triton as _torch_triton
from torch.utils._python_dispatch import _get_current_dispatch_mode

OP_MODULES = (
    "swiglu",
    "rmsnorm",
    "softmax",
    "cross_entropy",
    "fused_linear_ce",
    "fused_linear_kd",
    "quant_matmul",
    "codebook_matmul",
)

_triton_on_cpu = False


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@contextlib.contextmanager
def triton_on_cpu(enabled: bool = True, *, captured: bool = False) -> Iterator[None]:
    """Route CPU tensors through the Triton launchers (under the interpreter) instead of the reference.
    ``captured``: the launches are captured, not run (``launch.capture``), so no interpreter is needed."""
    global _triton_on_cpu
    if enabled and not interpreting() and not captured:
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
    return not tensor.is_cuda and not _triton_on_cpu  # is_cuda: 1 us less a call than device.type


# Tensor types the fast path takes as they are; any other subclass may override dispatch.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def eager(*tensors: torch.Tensor | None) -> bool:
    """True when a functional call may take the fast path: nothing is tracing and every tensor is plain.

    Dynamo folds ``is_compiling()`` to True, so compiled code keeps calling the registered ops; AOT
    tracing, make_fx and fake tensors run under a dispatch mode; functorch transforms wrap tensors. A mode
    marked ``observes_only`` (replay.py's recorder: it notes each op and runs it unchanged) is not tracing.
    """
    if torch.compiler.is_compiling():
        return False
    mode = _get_current_dispatch_mode()
    if mode is not None and not getattr(mode, "observes_only", False):  # (a launch plan's recording)
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    return all(t is None or type(t) in _PLAIN for t in tensors)


@dataclass(frozen=True)
class EagerOp:
    """An op's body and autograd formulas, callable without the dispatcher.

    ``forward`` is the function registered with ``triton_op``; ``setup_context`` and ``backward`` have
    ``register_autograd``'s signatures, with ``backward`` calling the backward op's body directly.
    ``materialize_grads=False`` hands ``backward`` None for outputs nothing used, instead of autograd's
    zero-filled tensors: the fused losses return their gradients as outputs, which no caller backpropagates
    through, and zeros for them doubled the gradients' memory at the backward's peak (FLCE at N=16k,
    V=128k, H=4096 on the H100: 2260 MB with 1130 MB of gradients, 1256 without the zeros; NOTES.md).
    ``plans`` (a ``replay.LaunchPlans``) runs calls that need no gradient through recorded launch plans.
    """

    forward: Callable[..., Any]
    setup_context: Callable[[Any, tuple, Any], None]
    backward: Callable[..., tuple]
    materialize_grads: bool = True
    plans: Callable[[Callable[..., Any], tuple], Any] | None = None

    def __call__(self, *inputs: Any) -> Any:
        if torch.is_grad_enabled():
            for t in inputs:
                if getattr(t, "requires_grad", False):  # a loop: a third of any()'s time
                    return _EagerFunction.apply(self, *inputs)
        if self.plans is not None:
            return self.plans(self.forward, inputs)
        with direct_launches:
            return self.forward(*inputs)


class _EagerFunction(torch.autograd.Function):
    """One autograd node around an op body; launches go straight to the Triton kernels (no HOP)."""

    @staticmethod
    def forward(ctx, op: EagerOp, *inputs):
        ctx.set_materialize_grads(op.materialize_grads)
        with direct_launches:
            output = op.forward(*inputs)
        op.setup_context(ctx, inputs, output)
        ctx.op = op
        return output

    @staticmethod
    def backward(ctx, *grads):
        with direct_launches:
            return None, *ctx.op.backward(ctx, *grads)


class _DirectLaunches:
    """``torch._library.triton.set_wrap_triton_enabled(False)`` as a class: launches inside go straight to the
    kernels, not through the HOP. It wraps every eager op call; torch's generator-based context manager costs
    2.2-2.8 us an entry and exit, this one 0.9-1.3 (timeit, AMD EPYC AVX2, 2026-11-24)."""

    def __init__(self) -> None:
        self._saved = threading.local()  # per thread, a stack of the values entered over (nesting)

    def __enter__(self) -> None:
        tls = _torch_triton.wrap_triton_enabled
        stack = getattr(self._saved, "stack", None)
        if stack is None:
            stack = self._saved.stack = []
        stack.append(getattr(tls, "value", _torch_triton.wrap_triton_enabled_default))
        tls.value = False

    def __exit__(self, *exc) -> None:
        _torch_triton.wrap_triton_enabled.value = self._saved.stack.pop()


direct_launches = _DirectLaunches()
"""Context manager for code torch does not trace (eager calls, the bodies of custom ops opaque to
torch.compile): its kernel launches skip ``wrap_triton``'s higher-order op, which costs ~100 us of host
time a launch (tests/benchmarks/NOTES.md), and take ``launch.FastLaunch``."""


def load() -> None:
    """Import every op file so that all ``torch.ops.squeezeserve.*`` ops are registered."""
    for name in OP_MODULES:
        importlib.import_module(f"squeezeserve.kernels.ops.{name}")
