"""Eager launch plans: an op body's kernel launches, recorded once per input signature and replayed.

A decode-sized eager call of a memory-bound op is host time, not GPU time: the op body prepares its launch
in Python (views, strides, launch settings, the grid, Triton's specialization key) for ~20 us where the
kernel runs 2-5 us (tests/benchmarks/NOTES.md). None of that preparation depends on anything but the
inputs' shapes, strides, dtypes, devices, pointer alignment and the scalar arguments, so
:class:`LaunchPlans` runs the body once per such signature while recording what it does, and on later calls
with the same signature only allocates the outputs and calls the compiled kernels' launchers with the new
tensors in place of the recorded ones.

A body is replayable when, recorded: every launch went through ``launch.FastLaunch``'s cached path (or the
interpreter), every tensor a kernel received lies inside an input or an output (an offset into one is kept:
``x[..., d:]``; unless ``SQUEEZESERVE_NATIVE_REPLAY=0``, a TMA descriptor's tensor too, and a replay makes
the descriptor again over the call's), the outputs are fresh contiguous tensors, and no torch op other than
allocations and views ran (a copy, a fill or a scratch buffer would not be repeated by a replay). Anything
else runs the body on every call, as do calls that need gradients, calls whose inputs share memory (they
record nothing), CPU tensors on the reference path, and calls while a Triton launch hook (a profiler) is
installed. An op may name long-lived buffers its kernels use besides inputs and outputs (``persistent``:
quant_matmul's split-K workspace, which every kernel leaves zeroed): a plan holds such a buffer as a constant.
``SQUEEZESERVE_LAUNCH_PLANS=0`` turns plans off, as does ``SQUEEZESERVE_FAST_LAUNCH=0`` (every launch
through Triton's own dispatch).

Where the C++ extension builds (``kernels/ops/native.py``; ``SQUEEZESERVE_NATIVE_REPLAY=0`` turns it off), a
plan whose launches are all compiled kernels that ``cuLaunchKernel`` launches as Triton would is also handed
to it, and later calls of its signature are replayed there: signature, allocation and launches in one C call,
without the Python replay's signature tuple, ``torch.empty_like`` and Triton launcher (together 11.8 us of a
15.5 us softmax call on the H100's host: tests/benchmarks/NOTES.md). Calls it has no plan for come back to
Python. The same switch makes the Gluon kernel's launches (TMA descriptors) replayable, in C++ or in Python
(both measured on the H100: kernels/ops/native.py).
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from squeezeserve.kernels.ops import launch, native
from squeezeserve.kernels.registry import direct_launches, use_reference

LAUNCH_PLANS = os.environ.get("SQUEEZESERVE_LAUNCH_PLANS", "1") != "0"
# Signatures kept per op before the memo starts over (an eager prefill sees one per prompt length).
MAX_PLANS = 256
# Recordings of one signature that may fail (e.g. a first call that compiles and so runs Triton's own
# launch) before it runs the body on every call.
RECORD_ATTEMPTS = 2

_aten = torch.ops.aten
# Torch ops a replayable body may run: allocations, views and metadata (nothing that reads or writes memory).
_ALLOWED = frozenset({
    _aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty, _aten.new_empty_strided,
    _aten.view, _aten._unsafe_view, _aten.reshape, _aten.alias, _aten.slice, _aten.select, _aten.as_strided,
    _aten.t, _aten.transpose, _aten.permute, _aten.unsqueeze, _aten.squeeze, _aten.expand, _aten.detach,
    _aten.split, _aten.chunk, _aten.unbind, _aten.promote_types, _aten.result_type,
})  # fmt: skip


class _OnlyViews(TorchDispatchMode):
    """Notes whether any torch op other than an allocation or a view runs while it is active.

    An op that returns one of its inputs unchanged did nothing either: inside a custom op (below autograd)
    ``y.to(y.dtype)`` and ``x.contiguous()`` of a contiguous x reach this mode as ``aten.to`` /
    ``aten.contiguous`` returning their input; outside one they resolve above it and are never seen. An
    in-place op returns its input too, and is noted: it writes. (Noting them made every recording through
    ``quant_matmul_opaque`` fail: vLLM's warm-up calls at load, the same signature in all 32 layers, used
    up the recording attempts of the prompt sizes it warms, and those prompts' split-K calls then ran the
    whole body on every call: the H100, 2026-11-25, fifteenth session.)"""

    observes_only = True  # runs every op as it is: registry.eager() does not count it as tracing

    def __init__(self) -> None:
        super().__init__()
        self.other: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket not in _ALLOWED and (
            func._schema.is_mutable or not any(out is a for a in args)
        ):
            self.other.append(str(func))
        return out


def signature(inputs: tuple) -> tuple:
    """What an op body's launches depend on: per tensor its shape, strides, dtype, device and whether its
    address is 16-byte aligned; per other argument its type and value (1, 1.0 and True differ)."""
    key = []
    for a in inputs:
        if isinstance(a, torch.Tensor):
            key.append((a.shape, a.stride(), a.dtype, a.get_device(), a.data_ptr() % 16 == 0))
        else:
            key.append((type(a), a))
    return tuple(key)


class _Plan:
    """Outputs to allocate and launches to repeat. A launch's arguments are ``(None, value)`` for a constant
    and ``(index, where)`` for a tensor: ``pool[index]`` of the call's inputs followed by its outputs, itself
    (``where`` None) or ``(byte offset, view)`` into it (see :func:`_argument`)."""

    __slots__ = ("outputs", "launches", "single")

    def __init__(self, outputs: list, launches: list, single: bool):
        self.outputs = outputs  # [allocate(inputs) -> tensor]
        self.launches = launches  # [(launch, [(index, where) | (None, constant)])]
        self.single = single

    def __call__(self, inputs: tuple):
        outs = [allocate(inputs) for allocate in self.outputs]
        pool = (*inputs, *outs)
        for run, spec in self.launches:
            run([value if index is None else _argument(pool[index], value) for index, value in spec])
        return outs[0] if self.single else tuple(outs)


class _DescriptorAt(tuple):
    """Where a TMA descriptor argument (the Gluon kernel's) lies in a plan's pool: ``(byte offset, the
    recorded descriptor)``. A replay makes the descriptor again over the call's tensor: the same shape,
    strides, block and layout (the signature fixes them), another base."""

    __slots__ = ()


def _descriptor(t: torch.Tensor, offset: int, recorded):
    base = recorded.base
    if offset or t.shape != base.shape or t.stride() != base.stride():
        base = t.as_strided(base.shape, base.stride(), t.storage_offset() + offset // t.element_size())
    else:
        base = t  # (the recorded call's tensor until the twenty-fifth session: replays read its memory)
    made = object.__new__(type(recorded))  # (its checks ran when it was recorded: same signature)
    made.__dict__.update(recorded.__dict__)
    made.base = base
    return made


def _argument(t: torch.Tensor, where: tuple | None):
    """The kernel argument in ``t``: ``t`` itself (``where`` None, it starts there), or ``offset`` bytes into
    it for ``where = (offset, view)``: an address for a compiled launcher (``view`` None), a view (its sizes
    and strides, ``t``'s dtype) for the interpreter, which takes only tensors; or a TMA descriptor over it
    (``where`` a :class:`_DescriptorAt`)."""
    if where is None:
        return t
    if type(where) is _DescriptorAt:
        return _descriptor(t, *where)
    offset, view = where
    if view is None:
        return t.data_ptr() + offset
    return t.as_strided(view[0], view[1], t.storage_offset() + offset // t.element_size())


def _allocator(out: torch.Tensor, inputs: tuple):
    """``allocate(inputs)`` making a tensor like ``out``: ``torch.empty_like`` of an input of its shape where
    that gives ``out``'s strides (1.5 us a call against ``torch.empty``'s 5 with its keywords), else
    ``torch.empty``."""
    for i, a in enumerate(inputs):
        if not isinstance(a, torch.Tensor) or a.shape != out.shape or a.device != out.device:
            continue
        if a.dtype == out.dtype:
            allocate = lambda inputs, i=i: torch.empty_like(inputs[i])  # noqa: E731
        else:
            allocate = lambda inputs, i=i, dtype=out.dtype: torch.empty_like(inputs[i], dtype=dtype)  # noqa: E731
        if allocate(inputs).stride() == out.stride():
            return allocate
    return lambda inputs, shape=out.shape, dtype=out.dtype, device=out.device: torch.empty(
        shape, dtype=dtype, device=device
    )


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, one past the last byte] that ``t`` addresses (dense or strided, non-negative strides)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _inside(address: int, extent: tuple[int, int]) -> bool:
    start, end = extent
    return start <= address < end or address == start  # an empty tensor's address is its start


def _aliased(inputs: tuple) -> bool:
    """Whether two tensor inputs share memory (``add_rmsnorm(x, x, w)``)."""
    extents = [_extent(t) for t in inputs if isinstance(t, torch.Tensor) and t.numel()]
    return any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(extents) for b in extents[i + 1 :])


def _build(inputs: tuple, result, launches: list, other_ops: list, persistent=()) -> _Plan | None:
    """The plan for what one recorded body call did, or None when a replay could not repeat it.
    ``persistent``: long-lived tensors a kernel argument may lie in (kept as constants)."""
    single = isinstance(result, torch.Tensor)
    outs = [result] if single else list(result) if isinstance(result, tuple) else None
    if outs is None or other_ops or not launches or any(entry is None for entry in launches):
        return None
    if not all(isinstance(o, torch.Tensor) and o.is_contiguous() for o in outs):
        return None
    pool = (*inputs, *outs)
    extents = [_extent(t) if isinstance(t, torch.Tensor) else None for t in pool]
    in_extents = [e for e in extents[: len(inputs)] if e is not None]
    for o in extents[len(inputs) :]:  # fresh outputs: no input shares their memory
        if any(o[0] < e[1] and e[0] < o[1] for e in in_extents):
            return None
    # An output is never inside an input (checked above): look there first, then in the inputs.
    order = [*range(len(inputs), len(pool)), *range(len(inputs))]

    def home_of(address: int) -> int | None:
        return next((i for i in order if extents[i] and _inside(address, extents[i])), None)

    plan_launches = []
    for run, args in launches:
        spec = []
        for a in args:
            if isinstance(a, launch.DESCRIPTORS):
                if not (native.NATIVE_REPLAY and isinstance(run, launch.CompiledLaunch)):
                    return None  # (descriptor plans come with the C++ replay: module docstring)
                address = a.base.data_ptr()
                home = home_of(address)
                if home is None or pool[home].dtype != a.base.dtype:
                    return None  # (a descriptor over a buffer the body made, or a reinterpreted one)
                spec.append((home, _DescriptorAt((address - extents[home][0], a))))
                continue
            if not isinstance(a, torch.Tensor):
                spec.append((None, a))
                continue
            address = a.data_ptr()
            home = home_of(address)
            if home is None:
                if any(_inside(address, _extent(p)) for p in persistent):
                    spec.append((None, a))  # a long-lived buffer: the same one on every replay
                    continue
                return None  # a tensor the body made and did not return: a replay would not make it
            offset = address - extents[home][0]
            view = None
            if offset and not isinstance(run, launch.CompiledLaunch):
                if a.dtype != pool[home].dtype:
                    return None
                view = (a.shape, a.stride())
            spec.append((home, (offset, view) if offset else None))
        plan_launches.append((run, spec))
    return _Plan([_allocator(o, inputs) for o in outs], plan_launches, single)


def _native_argument(index: int | None, where):
    """A recorded launch argument as native.launch_spec takes it (``_Plan``'s ``(index, where)`` terms)."""
    if index is None:
        return where  # a constant
    if type(where) is _DescriptorAt:
        return native.TensorMapAt((index, *where))
    return native.PoolAddress((index, where[0] if where else 0))


def _native_spec(plan: _Plan, inputs: tuple, outs: list, device: int) -> tuple | None:
    """``Replayer.add``'s arguments for ``plan`` (recorded from ``inputs`` making ``outs`` on CUDA
    ``device``), or None where some launch is not one the extension makes (native.launch_spec)."""
    sig = [native.input_spec(a) for a in inputs]
    if any(s is None for s in sig):
        return None
    launches = []
    for run, spec in plan.launches:
        if not isinstance(run, launch.CompiledLaunch):
            return None
        args = [_native_argument(index, value) for index, value in spec]
        described = native.launch_spec(run.compiled, run.function, (run.x, run.y, run.z), [*args, *run.tail])
        if described is None:
            return None
        launches.append(described)
    outputs = [(tuple(o.shape), o.dtype, o.get_device()) for o in outs]
    return sig, device, outputs, launches, plan.single


class LaunchPlans:
    """Per op, the launch plans of its eager calls without gradients (module docstring); ``plans(body,
    inputs)`` returns ``body(*inputs)``."""

    def __init__(self, persistent=None, max_plans: int | None = None) -> None:
        self.plans: dict[tuple, _Plan | int] = {}  # signature -> plan, or failed recordings so far
        self.persistent = persistent  # () -> the long-lived tensors a plan may hold (module docstring)
        self.max_plans = max_plans  # None: MAX_PLANS
        self.native = None  # the extension's Replayer, made with the first plan it takes

    def __call__(self, body, inputs: tuple):
        hooks = launch.launch_hooks()
        if self.native is not None and not hooks:
            result = self.native(*inputs)
            if result is not None:
                return result
        first = inputs[0]  # every op with plans takes a tensor first
        if not (LAUNCH_PLANS and launch.FAST_LAUNCH) or use_reference(first) or hooks:
            with direct_launches:
                return body(*inputs)
        key = signature(inputs)
        if first.is_cuda:
            key = (key, torch._C._cuda_getDevice())  # the device Triton launches on
        plan = self.plans.get(key, 0)
        if type(plan) is _Plan:
            return plan(inputs)
        if plan >= RECORD_ATTEMPTS:
            with direct_launches:
                return body(*inputs)
        return self._record(key, plan, body, inputs)

    def replayed(self, *inputs):
        """The call's result replayed in C++, or None (no extension, no plan for these inputs, gradients
        needed, something tracing or hooked): then the caller takes its usual path. The functional ops try
        this first: a hit skips ``registry.eager``, ``EagerOp`` and ``__call__``, whose Python layers cost the
        H100's host 3.2 us of an 8.3 us softmax 1x4096 call, the replayer alone 5.1
        (tests/gpu/launch_probe.py; NOTES.md, fifteenth session). The extension's call itself refuses calls
        while a launch hook is set, calls needing gradients, under a dispatch mode or a functorch transform,
        and tensor subclasses; torch.compile is checked here (kernels/functional.py inlines this)."""
        if torch.compiler.is_compiling():  # first: dynamo then never reads (and guards on) ``native``
            return None
        native = self.native
        return None if native is None else native(*inputs)

    def clear(self) -> None:
        """Forget every plan (Python's and the extension's)."""
        self.plans.clear()
        if self.native is not None:
            self.native.clear()

    def _record(self, key: tuple, failures: int, body, inputs: tuple):
        launches: list = []
        views = _OnlyViews()
        launch.recording.launches = launches
        try:
            with direct_launches, views:
                result = body(*inputs)
        finally:
            launch.recording.launches = None
        if _aliased(inputs):
            # A kernel argument in the shared memory could belong to either input: a plan might hand a later
            # call's other input to the kernel. Nothing is recorded; the next call of the signature records.
            return result
        if len(self.plans) >= (self.max_plans or MAX_PLANS):
            self.clear()
        persistent = self.persistent() if self.persistent is not None else ()
        plan = _build(inputs, result, launches, views.other, persistent)
        self.plans[key] = plan or failures + 1
        if plan is not None and inputs[0].is_cuda:
            self._add_native(plan, inputs, result, key[1])
        return result

    def _add_native(self, plan: _Plan, inputs: tuple, result, device: int) -> None:
        """Hand ``plan`` to the C++ replayer where the extension is built and takes it."""
        module = native.load()
        if module is None:
            return
        spec = _native_spec(plan, inputs, [result] if plan.single else list(result), device)
        if spec is None:
            return
        if self.native is None:
            self.native = module.Replayer(self.max_plans or MAX_PLANS)
        self.native.add(*spec)
