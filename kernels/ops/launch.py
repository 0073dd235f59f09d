"""Launch settings shared by the row-wise kernels (one program per row, the row in one block)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from collections.abc import Iterator

import torch
import triton
from torch._library.triton import is_wrap_triton_enabled
from torch.library import wrap_triton
from torch.utils._python_dispatch import _disable_current_modes
from triton import knobs
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction

from squeezeserve.kernels.registry import direct_launches, eager, interpreting, triton_on_cpu

try:  # host-side TMA descriptors (Gluon's and Triton's), where this Triton has them
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor
    from triton.tools.tensor_descriptor import TensorDescriptor as _TritonDescriptor

    DESCRIPTORS: tuple = (_GluonDescriptor, _TritonDescriptor)
except ImportError:  # pragma: no cover - Triton without Gluon
    DESCRIPTORS = ()

# The widest row a single-block kernel holds in registers; wider rows need a looping kernel.
MAX_FUSED_COLS = 65536


# Host-side launch arithmetic. triton.cdiv / triton.next_power_of_2 are constexpr functions in Triton
# >= 3.4: called from Python each unwraps its arguments as constexprs (microseconds a call; figures in
# tests/benchmarks/NOTES.md), and launchers make several per launch.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def traced(*tensors: torch.Tensor | None) -> bool:
    """Whether torch is tracing a launch on ``tensors`` (torch.compile's decomposition of a triton_op): it
    goes through ``wrap_triton`` (:func:`traceable`) and the call is not an eager one (registry.eager). Such
    a kernel is launched by torch.compile's code, never as anything's programmatic dependent: it leaves out
    launch_dependents (:func:`launches_dependents`), whose inline PTX keeps torch from telling which
    arguments the kernel writes (torch then takes every argument as written: aot_eager copies each, the
    weights too, each call)."""
    return is_wrap_triton_enabled() and not eager(*tensors)


def lets_dependents_start(x: torch.Tensor) -> bool:
    """A forward kernel's ``LAUNCH_DEPENDENTS`` for a launch on ``x``: :func:`launches_dependents` on its
    device, but not where the launch is :func:`traced`."""
    return launches_dependents(x.device) and not traced(x)


def no_workspace(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The workspace and count arguments of a launch whose split parts never meet there (one part a tile,
    or fp32 atomics into y): ``y`` again on eager calls; where torch may be tracing the launch, empty
    tensors of their own. torch.compile gives a kernel whose writes its analysis of the kernel cannot follow
    (inline PTX not marked pure: the prefill GEMM's wgmma waits, launch_dependents) a clone of each argument,
    and takes an argument passed more than once back from its last clone: a ``y`` passed as the workspace
    too came back unwritten (every output wrong under torch.compile on the H200: NOTES.md, forty-second
    session)."""
    if is_wrap_triton_enabled():
        return y.new_empty(0, dtype=torch.float32), y.new_empty(0, dtype=torch.int32)
    return y, y


def traceable(kernel: triton.JITFunction):
    """``kernel`` to index with a grid: wrapped by ``wrap_triton`` where torch may be tracing the launch
    (torch.compile's decomposition of a triton_op); on eager paths a :class:`FastLaunch` of it, which
    launches a specialization Triton has already compiled without Triton's per-call dispatch
    (``wrap_triton`` would add two wrapper objects per launch on top of that dispatch)."""
    if is_wrap_triton_enabled():
        return wrap_triton(kernel)
    if not isinstance(kernel, JITFunction):  # the interpreter's kernels: nothing compiled to call directly
        return _InterpretedRecord(kernel) if recording.launches is not None else kernel
    fast = _FAST.get(kernel)
    if fast is None:
        fast = _FAST[kernel] = FastLaunch(kernel)
    return fast


def specialization_key(args: tuple, constexprs: dict, constexpr_positions: frozenset = frozenset()) -> tuple:
    """What Triton's launch specializes a compiled kernel on, or finer: per tensor its dtype and whether its
    address is 16-byte aligned; per int whether it is 1, a multiple of 16, and which of Triton's integer
    types holds it; bools, floats and None by kind; per TMA descriptor its tensor's dtype and alignment, its
    block, shared-memory layout and padding, and its shape and strides as ints; constexprs passed by
    position (``constexpr_positions``) and every keyword (constexprs, num_warps, num_stages, maxnreg) by
    value, keywords in the order given (one call site passes them in one order). Two launches with equal
    keys run the same compiled kernel."""
    key = []
    for i, a in enumerate(args):
        if i in constexpr_positions:
            key.append(("constexpr", a))
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, DESCRIPTORS):
            ints = tuple((v == 1, v % 16 == 0, v < 2**31) for v in (*a.shape, *a.strides))
            key.append((a.base.dtype, a.base.data_ptr() % 16 == 0, *a.block_shape, a.layout, a.padding, ints))
        elif isinstance(a, bool) or a is None or isinstance(a, float):
            key.append(type(a))
        elif isinstance(a, int):
            key.append((a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a >= 2**63))
        else:
            return None  # anything else (tuples, descriptors): Triton's own launch decides
    return (*key, *constexprs.items())


# Triton's num_stages where a launch names none (CUDAOptions' default).
DEFAULT_STAGES = 3


def fewer_stages(kwargs: dict, error: Exception) -> dict | None:
    """``kwargs`` with one pipeline stage fewer, where ``error`` says the kernel needs more shared memory
    than the GPU has and a stage can go; else None. Our tilings are the H100's (227 KB a block); an A100 has
    163 KB, sm_86 / sm_89 parts 99 KB, and each stage of a pipelined loop holds one more copy of the tiles it
    prefetches (the 33-64-row int4 g32 decode tiling: 146 KB at 4 stages, 98 at 3, 50 at 2;
    kernels/ops/cross_compile.py compiles it for sm_80 / sm_89)."""
    stages = kwargs.get("num_stages", DEFAULT_STAGES)
    if not isinstance(error, OutOfResources) or error.name != "shared memory" or stages <= 1:
        return None
    return kwargs | {"num_stages": stages - 1}


def launch_fitting(kernel, grid, args: tuple, kwargs: dict):
    """``kernel[grid](*args, **kwargs)``, with fewer pipeline stages where the GPU's shared memory does not
    hold the tiling (:func:`fewer_stages`): the same results, a slower pipeline, not an error. Returns
    what Triton's launch returns (the compiled kernel)."""
    while True:
        try:
            return kernel[grid](*args, **kwargs)
        except OutOfResources as e:  # raised before the kernel runs, as Triton loads it
            kwargs = fewer_stages(kwargs, e)
            if kwargs is None:
                raise


class FastLaunch:
    """Eager launches of one ``@triton.jit`` kernel: ``FastLaunch(k)[grid](*args, **constexprs)``.

    Triton's ``kernel[grid](...)`` binds and specializes the arguments, hashes a cache key, checks the
    kernel's globals and builds launch metadata for its (empty) hooks on every call: microseconds of host
    time per launch that decode-sized kernels do not hide. The first launch of a specialization
    (:func:`specialization_key`) goes through Triton, which compiles it and returns the compiled kernel;
    later launches with the same key call that kernel's launcher directly with the arguments Triton would
    pass (the positional ones, then every remaining parameter, constexprs included, in signature order).
    Anything Triton's own launch would treat differently takes Triton's path: a callable grid, launch
    hooks (profilers), arguments other than tensors and scalars, the interpreter (no compiled kernel), or
    ``SQUEEZESERVE_FAST_LAUNCH=0``.
    """

    __slots__ = ("kernel", "names", "defaults", "constexpr_positions", "compiled")

    def __init__(self, kernel: triton.JITFunction):
        self.kernel = kernel
        self.names = list(kernel.arg_names)
        params = inspect.signature(kernel.fn).parameters
        self.constexpr_positions = frozenset(
            i for i, p in enumerate(params.values()) if "constexpr" in str(p.annotation)
        )
        self.defaults = {n: p.default for n, p in params.items() if p.default is not p.empty}
        # (device, key) -> (launcher, function, packed metadata, the parameters after the positional ones,
        # the compiled kernel)
        self.compiled: dict[tuple, tuple] = {}

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def tail(self, positional: int, kwargs: dict) -> tuple:
        """The kernel's parameters after its first ``positional`` ones, as its launcher takes them: each
        from ``kwargs`` or its default, in signature order (constexprs included)."""
        return tuple(kwargs[n] if n in kwargs else self.defaults[n] for n in self.names[positional:])

    def launch(self, grid, *args, **kwargs):
        if recording.captured is not None:
            return recording.captured.append((self.kernel, grid, args, kwargs))
        launches = recording.launches
        if not FAST_LAUNCH or type(grid) is not tuple or launch_hooks():
            if launches is None:
                return launch_fitting(self.kernel, grid, args, kwargs)
            launches.append(None)  # not replayable: Triton's own launch decides
            with _disable_current_modes():  # its torch calls are not the body's
                return launch_fitting(self.kernel, grid, args, kwargs)
        key = specialization_key(args, kwargs, self.constexpr_positions)
        device = torch._C._cuda_getDevice()  # what Triton's launch uses: the current device
        try:
            entry = self.compiled.get((device, key)) if key is not None else None
        except TypeError:  # an unhashable keyword
            key = entry = None
        if entry is None:
            # (the kernel that fits is kept under this key: later launches run it straight away)
            if launches is None:
                compiled = launch_fitting(self.kernel, grid, args, kwargs)
            else:
                with _disable_current_modes():  # Triton's torch calls are not the recorded body's
                    compiled = launch_fitting(self.kernel, grid, args, kwargs)
            if key is not None and hasattr(compiled, "packed_metadata"):
                tail = self.tail(len(args), kwargs)
                entry = self.compiled[(device, key)] = (
                    compiled.run,
                    compiled.function,
                    compiled.packed_metadata,
                    tail,
                    compiled,
                )
            if launches is not None:
                launches.append(None if entry is None else (CompiledLaunch(entry, device, grid), args))
            return compiled
        if launches is not None:
            launches.append((CompiledLaunch(entry, device, grid), args))
        run, function, metadata, tail, _ = entry
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _current_stream(device), function,
            metadata, None, None, None, *args, *tail)  # fmt: skip
        return None


class CompiledLaunch:
    """A compiled kernel's launch on one grid as :class:`FastLaunch` makes it, for ``replay.LaunchPlans`` to
    repeat with other arguments: ``launch(args)``."""

    __slots__ = ("run", "function", "metadata", "tail", "compiled", "device", "x", "y", "z")

    def __init__(self, entry: tuple, device: int, grid: tuple):
        self.run, self.function, self.metadata, self.tail, self.compiled = entry
        self.device = device
        self.x, self.y, self.z = (*grid, 1, 1)[:3]

    def __call__(self, args: list) -> None:
        stream = _current_stream(self.device)
        self.run(self.x, self.y, self.z, stream, self.function, self.metadata, None, None, None, *args,
                 *self.tail)  # fmt: skip


class _InterpretedRecord:
    """An interpreter kernel launched while :data:`recording`: the launch runs and is recorded with its
    keywords, so that a replay runs it again (how the interpreter tests exercise ``replay.LaunchPlans``)."""

    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            recording.launches.append((_interpreted_launch(self.kernel, grid, kwargs), args))
            with _disable_current_modes():  # the interpreter copies tensors with torch ops: not the body's
                return self.kernel[grid](*args, **kwargs)

        return launch


def _interpreted_launch(kernel, grid, kwargs: dict):
    """``launch(args)`` running ``kernel[grid](*args, **kwargs)``."""
    return lambda args: kernel[grid](*args, **kwargs)


class _Recording(threading.local):
    """Per thread: the list that launches append ``(launch, args)`` to (None for one that cannot be
    repeated), while ``replay.LaunchPlans`` records an op body; None otherwise. While :func:`capture` runs:
    the GPU the launches are planned for (``target``: its SM count and whether it has wgmma) and the list
    that each launch appends ``(kernel, grid, args, kwargs)`` to instead of running (``captured``)."""

    launches: list | None = None
    target: tuple[int, bool] | None = None
    captured: list | None = None


recording = _Recording()
_FAST: dict = {}
# Off switch for the fast path (every launch through Triton's own dispatch).
FAST_LAUNCH = os.environ.get("SQUEEZESERVE_FAST_LAUNCH", "1") != "0"


def launch_hooks() -> bool:
    """True when a launch hook is installed (a profiler such as proton): Triton's launch runs it. Triton 3.6
    keeps an empty hook chain there by default, older releases None."""
    runtime = knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return bool(enter is not None and getattr(enter, "calls", True)) or bool(
        leave is not None and getattr(leave, "calls", True)
    )


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def row_block(n_cols: int, op: str, limit: int = MAX_FUSED_COLS) -> int:
    """Block width for a row of ``n_cols`` elements; raises when the row does not fit one block."""
    if n_cols < 1:
        raise ValueError(f"{op}: the last dimension must be at least 1, got {n_cols}")
    if n_cols > limit:
        raise ValueError(f"{op}: rows of {n_cols} elements exceed the {limit}-element limit of this kernel")
    return next_power_of_2(n_cols)


def num_warps_for(block: int) -> int:
    """Warp ladder: enough threads that each holds at most ~64 fp32 values of the row."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def block_rows(n_rows: int, block: int) -> int:
    """Rows per program for narrow rows: tiles of about ``TILE_ELEMENTS`` elements.

    On a GPU this keeps enough bytes in flight per program for rows narrower than 2048; under the
    interpreter every program costs milliseconds, so it packs 16k elements into each.
    """
    tile = 16384 if interpreting() else 2048
    most = max(1, tile // block)
    if not isinstance(n_rows, int):
        # A symbolic row count (torch.compile tracing a triton_op, as vLLM does for every batch size up to
        # max_num_batched_tokens): the widest tile, with no guard on the row count. Rounding it to a power
        # of two would specialise the whole graph to the traced size (vLLM then refuses to start).
        return most
    return max(1, min(next_power_of_2(max(n_rows, 1)), most))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device; while :func:`capture` runs, the
    target's)."""
    if recording.target is not None:
        return recording.target[0]
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _wgmma(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] == 9


def wgmma(device: torch.device) -> bool:
    """Whether Triton's dots on this CUDA device are Hopper's asynchronous wgmma (compute capability 9.x:
    the H100 / H200; not Ampere's synchronous mma, not Blackwell's tcgen05, not ROCm). Cached per device;
    while :func:`capture` runs, the target's."""
    if recording.target is not None:
        return recording.target[1]
    return _wgmma(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _grid_dependency_control(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] >= 9


def launches_dependents(device: torch.device) -> bool:
    """Whether our forward kernels on this device (norms, SwiGLU, the decode GEMMs) call
    ``griddepcontrol.launch_dependents`` first (their ``LAUNCH_DEPENDENTS``): a kernel launched after one of
    them as its programmatic dependent (vllm_ops.PDL_AFTER) may then start while it runs. CUDA
    compute capability 9.0 and up (the PTX instruction's least), compiled kernels (not the interpreter);
    while :func:`capture` runs, a Hopper target's. Without such a dependent the instruction does nothing.
    Launch sites take :func:`traced` launches out."""
    if recording.target is not None:
        return recording.target[1]
    if interpreting() or device.type != "cuda":
        return False
    return _grid_dependency_control(device.index if device.index is not None else torch.cuda.current_device())


def graph_dependent(x: torch.Tensor) -> bool:
    """Whether a serving call on ``x`` launches its kernel as a programmatic dependent of the kernel before
    it: on a GPU whose kernels call launch_dependents (:func:`launches_dependents`), while a CUDA graph
    captures the call (vLLM's decode graphs), where the kernels then run back to back whatever the host
    does. Eager calls launch as before: their launch plans replay in C++, which launches without PDL."""
    return x.is_cuda and torch._C._cuda_isCurrentStreamCapturing() and launches_dependents(x.device)


def capturing() -> bool:
    """Whether :func:`capture` runs (CPU tensors then stand for a GPU's)."""
    return recording.target is not None


@contextlib.contextmanager
def capture(sms: int = 132, wgmma: bool = True) -> Iterator[list]:
    """Run op bodies on CPU tensors as they would run on a GPU of ``sms`` SMs (with Hopper's wgmma or not),
    taking the paths and tilings they would take there, and collect every kernel launch as ``(kernel, grid,
    args, kwargs)`` instead of running it (CPU tensors stand for device ones: same dtypes, alignment and
    strides). What the kernels would compute is not computed: outputs stay as allocated. For compiling
    what a GPU would run on a machine without one (``cross_compile``). Needs compiled kernels (not
    ``TRITON_INTERPRET=1``), and a process of its own: CPU tensors take the kernel paths in every thread
    while it runs (``registry.triton_on_cpu``), and only this thread's launches are captured."""
    if interpreting():
        raise RuntimeError("launch.capture() needs compiled kernels: unset TRITON_INTERPRET before importing")
    if recording.captured is not None:
        raise RuntimeError("launch.capture() does not nest")
    captured: list = []
    recording.target, recording.captured = (sms, wgmma), captured
    try:
        with triton_on_cpu(captured=True), direct_launches:  # (as eager callers launch: through FastLaunch)
            yield captured
    finally:
        recording.target = recording.captured = None


def persistent_programs(device: torch.device, n_rows: int) -> int:
    """Programs for a kernel that loops over rows: one per SM on a GPU, a few under the interpreter."""
    most = sm_count(device) if device.type == "cuda" or recording.target is not None else 4
    if not isinstance(n_rows, int):  # symbolic (see block_rows): no guard on the row count
        return most
    return max(1, min(n_rows, most))


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as [rows, last dim] with a unit stride along the last dim (copies only if needed)."""
    if x.dim() == 0:
        raise ValueError("expected a tensor with at least one dimension, got a scalar")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


class Workspace:
    """Long-lived scratch tensors, one set per device, that the kernels using them leave zero (so no call
    fills them, and a launch plan holds them as constants): ``workspace(device, *numels)`` returns tensors of
    at least those sizes, of the dtypes and minimum sizes given as ``(dtype, minimum)`` pairs. Grown on
    demand, to at least twice the size it replaces: a replaced set is kept alive, as plans and CUDA graphs
    made earlier still point at it, so calls of ever larger sizes (a server's row counts as they come) keep at
    most about as much again as the largest set, where growing to each size asked kept their sum. Kernels on
    one stream run one after another; two streams using one device's set at once would share it (serving
    engines use one)."""

    def __init__(self, *specs: tuple[torch.dtype, int]) -> None:
        self.specs = specs
        self.current: dict[tuple[str, int | None], tuple[torch.Tensor, ...]] = {}
        self.retired: list[tuple[torch.Tensor, ...]] = []

    def __call__(self, device: torch.device, *numels: int) -> tuple[torch.Tensor, ...]:
        key = (device.type, device.index)
        tensors = self.current.get(key)
        if tensors is None or any(t.numel() < n for t, n in zip(tensors, numels, strict=True)):
            twice = [0] * len(numels) if tensors is None else [2 * t.numel() for t in tensors]
            if tensors is not None:
                self.retired.append(tensors)
            tensors = tuple(
                torch.zeros(max(n, minimum, grown), dtype=dtype, device=device)
                for (dtype, minimum), n, grown in zip(self.specs, numels, twice, strict=True)
            )
            self.current[key] = tensors
        return tensors

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor of every set, current and replaced (all kept alive and zero)."""
        return [t for group in (*self.current.values(), *self.retired) for t in group]
