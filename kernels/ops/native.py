"""Launch plans replayed in C++ (``kernels/csrc/replay.cpp``): building the extension, describing plans to it.

``replay.LaunchPlans`` records what an eager op call launches; replaying the record in Python still costs the
H100's host 11.8 us of a 15.5 us call (softmax 16x32768; torch.softmax takes 9.9: tests/benchmarks/NOTES.md,
2026-11-24 and fourteenth session). The
extension replays a plan without Python objects per argument: signature, allocation, kernel parameters and
``cuLaunchKernel`` in one C call. It is compiled on first use with the machine's C++ compiler against the
installed torch (as Triton compiles its launchers), cached under ``$SQUEEZESERVE_HOME/native`` (default
``~/.cache/squeezeserve``) by the source's and torch's versions, and loaded from there afterwards. Where it
cannot be built (no compiler, no headers) the Python replay runs, as before, and the reason is logged once.

On by default; ``SQUEEZESERVE_NATIVE_REPLAY=0`` turns it off, and with it the Gluon kernel's descriptor plans.
CI checks on CPU, byte for byte, that a replay passes our kernels (compiled for sm_90) what their op bodies
pass them (tests/kernels/test_native_replay.py). On the H100 (2026-11-25, fifteenth session) every plan of
tests/kernels/test_launch_plans.py and test_quant_matmul_gluon.py replayed through it equal to the op bodies
(the stream-K launches within one bf16 rounding step, as the body against itself), and
``tests/gpu/launch_probe.py`` timed an eager ``K.rmsnorm`` of 16x4096 at 8.7 us (15.7 replayed in Python;
``F.rms_norm`` 9.3); at the session's final code a 256-row ``quant_matmul_eager`` call took 7.2-7.4 us of host
time (18-26 replayed in Python; its body 64-78).

:func:`launch_spec` (through ``replay._native_spec``) turns a recorded plan whose every launch is a compiled
Triton kernel launched the way ``cuLaunchKernel`` launches (one CTA a cluster or the kernel's own clusters,
no programmatic dependent launch, no cooperative grid, no scratch buffers; TMA descriptors lowered to tensor
maps, which the extension encodes for each call's addresses) into the extension's description; any other
plan stays a Python one.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
from triton import knobs

log = logging.getLogger(__name__)

NATIVE_REPLAY = os.environ.get("SQUEEZESERVE_NATIVE_REPLAY", "1") != "0"
MODULE = "_squeezeserve_replay"
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "replay.cpp"

_loaded: list = []  # [module or None] once load() has run


def cache_dir() -> Path:
    """``$SQUEEZESERVE_NATIVE_DIR`` (an image's build, made at its build: docker/worker-vllm.Dockerfile), else
    ``$SQUEEZESERVE_HOME/native``."""
    if os.environ.get("SQUEEZESERVE_NATIVE_DIR"):
        return Path(os.environ["SQUEEZESERVE_NATIVE_DIR"]).expanduser()
    # (service/paths.py's home(), written again: kernels import nothing of the service, tests/test_layers.py)
    home = os.environ.get("SQUEEZESERVE_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "squeezeserve") / "native"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _build_key(source: bytes) -> str:
    """Source, torch, Python and compiler: a change in any builds a new file."""
    h = hashlib.sha256(source)
    for part in (
        torch.__version__,
        sys.version,
        sysconfig.get_config_var("EXT_SUFFIX") or "",
        _compiler() or "",
    ):
        h.update(part.encode())
    return h.hexdigest()[:16]


def build(out_dir: Path | None = None) -> Path:
    """Compile the extension (if its cached build is missing) and return the shared library's path. Raises
    RuntimeError saying what failed."""
    source = SOURCE.read_bytes()
    out_dir = out_dir or cache_dir()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target = out_dir / f"{MODULE}-{_build_key(source)}{suffix}"
    if target.exists():
        return target
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    torch_dir = Path(torch.__file__).resolve().parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = [
        "-O2", "-shared", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{sysconfig.get_paths()['include']}", f"-I{torch_dir / 'include'}",
        f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    ]  # fmt: skip
    libs = [f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
            f"-Wl,-rpath,{torch_dir / 'lib'}", "-ldl"]  # fmt: skip
    errors = []
    # torch >= 2.12's headers need C++20; older compilers know only C++17 (enough for older torch).
    for std in ("-std=c++20", "-std=c++17"):
        fd, tmp = tempfile.mkstemp(suffix=suffix, dir=out_dir)
        os.close(fd)
        cmd = [cxx, std, *flags, str(SOURCE), "-o", tmp, *libs]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode == 0:
            os.replace(tmp, target)  # atomic: a process loading it sees the whole file or none
            return target
        os.unlink(tmp)
        errors.append(f"{' '.join(cmd[:2])} ...: {done.stderr.strip()[-2000:]}")
    raise RuntimeError("building the replay extension failed:\n" + "\n".join(errors))


def _import(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    module.set_launch_hooks(knobs.runtime)  # (launch.launch_hooks's check, made by each replay in C)
    return module


def load():
    """The extension module, built on first use; None where it is off or cannot be built (logged once)."""
    if _loaded:
        return _loaded[0]
    module = None
    if NATIVE_REPLAY:
        try:
            module = _import(build())
        except Exception as e:  # noqa: BLE001 - any failure leaves the Python replay, which is correct
            log.warning("squeezeserve: launch plans replay in Python (%s)", e)
    _loaded.append(module)
    return module


# ---- plans as the extension takes them ----------------------------------------------------------------

# Triton's launcher parameter types (its signature strings) -> (bytes, struct format) of the C value.
_INT_TYPES = {
    "i1": (1, "b"), "i8": (1, "b"), "i16": (2, "h"), "i32": (4, "i"), "i64": (8, "q"),
    "u1": (1, "B"), "u8": (1, "B"), "u16": (2, "H"), "u32": (4, "I"), "u64": (8, "Q"),
}  # fmt: skip
_FLOAT_TYPES = {"fp16": (2, "e"), "fp32": (4, "f"), "f32": (4, "f"), "fp64": (8, "d")}


def _constant(ty: str, value) -> tuple | None:
    """("c", bytes, bits) for a scalar parameter of Triton type ``ty``, or None where it is not a scalar."""
    if ty in _INT_TYPES:
        size, fmt = _INT_TYPES[ty]
        return ("c", size, int.from_bytes(struct.pack("<" + fmt, int(value)), "little"))
    if ty == "bf16":  # Triton's launcher packs a bf16 scalar as the fp32 bits' high half, truncated
        return ("c", 2, int.from_bytes(struct.pack("<f", float(value)), "little") >> 16)
    if ty in _FLOAT_TYPES:
        size, fmt = _FLOAT_TYPES[ty]
        return ("c", size, int.from_bytes(struct.pack("<" + fmt, float(value)), "little"))
    return None


def input_spec(a) -> tuple | None:
    """One input's signature as the extension compares it (``replay.signature``'s terms)."""
    if a is None:
        return ("n",)
    if isinstance(a, torch.Tensor):
        if a.layout != torch.strided:
            return None
        return ("t", tuple(a.shape), tuple(a.stride()), a.dtype, a.get_device(), int(a.data_ptr() % 16 == 0))
    if type(a) is bool:
        return ("b", int(a))
    if type(a) is int:
        return ("i", a) if -(2**63) <= a < 2**63 else None
    if type(a) is float:
        return ("f", a)
    return None


class TensorMapAt(tuple):
    """A TMA descriptor argument over tensor ``pool`` of the pool, ``offset`` bytes in, made like
    ``recorded``: ``TensorMapAt((pool, offset, recorded))``."""

    __slots__ = ()


def _tensor_map(at: TensorMapAt, meta: dict | None) -> list | None:
    """The kernel parameters Triton's launcher makes of a host TMA descriptor lowered to a tensor map
    (``make_tensordesc_arg``): the CUtensorMap, as ``fillTMADescriptor`` encodes it (innermost dimension
    first, strides in bytes), then the shape as i32s and the strides as i64s. None where the descriptor was
    not lowered to a map, or is of a kind this does not make (fp4 padding, im2col, tf32 rounding)."""
    pool, offset, d = at
    if meta is None or meta.get("fp4_padded") or meta.get("is_im2col"):
        return None
    if getattr(d, "round_f32_to_tf32", False):
        return None
    try:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    except ImportError:
        return None
    shape, strides, block = list(d.shape), list(d.strides), list(meta["block_size"])
    rank, size = len(shape), meta["elem_size"]
    if strides[-1] != 1 or len(block) != rank:
        return None
    dims = shape[::-1]
    byte_strides = [size * s for s in strides[:-1]][::-1]  # the rank - 1 outer strides, innermost first
    box = block[::-1]
    fill = 1 if d.padding == "nan" else 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA, else NONE
    elem_type = TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]]
    tensor_map = ("m", pool, offset, elem_type, tuple(dims), tuple(byte_strides), tuple(box), meta["swizzle"])
    tensor_map += (fill,)
    return [tensor_map, *(("c", 4, v) for v in shape), *(_constant("i64", v) for v in strides)]


class PoolAddress(tuple):
    """A kernel argument that is an address ``offset`` bytes into tensor ``pool`` of a call's inputs followed
    by its outputs: ``PoolAddress((pool, offset))``."""

    __slots__ = ()


def launch_spec(compiled, function: int, grid: tuple, args: list) -> tuple | None:
    """(function, grid, block, shared, params) for one launch of ``compiled`` (a Triton ``CompiledKernel``)
    with ``args`` (every argument of the kernel's signature, in order: a :class:`PoolAddress`, a
    :class:`TensorMapAt`, a long-lived tensor, or a scalar), or None where the extension would not launch it
    as Triton's launcher does."""
    meta = compiled.metadata
    if getattr(getattr(meta, "target", None), "backend", None) != "cuda":
        return None
    ctas = getattr(meta, "num_ctas", 1)
    if getattr(meta, "launch_pdl", False) or (ctas != 1 and not _cluster_in_kernel(compiled, ctas)):
        return None
    if getattr(meta, "launch_cooperative_grid", False):
        return None
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        return None
    maps = iter(getattr(meta, "tensordesc_meta", None) or ())
    types = list(compiled.src.signature.values())
    if len(types) != len(args):
        return None
    params = []
    for ty, a in zip(types, args, strict=True):
        if ty == "constexpr":
            continue
        if not isinstance(ty, str):
            return None  # tuples of arguments: not taken here
        if ty.startswith("tensordesc"):
            made = _tensor_map(a, next(maps, None)) if isinstance(a, TensorMapAt) else None
            if made is None:
                return None
            params += made
            continue
        if ty.startswith("*"):
            if isinstance(a, PoolAddress):
                p = ("a", *a)
            elif isinstance(a, torch.Tensor):
                p = ("c", 8, a.data_ptr())  # a long-lived buffer (quant_matmul's workspace)
            else:
                p = None
        else:
            p = _constant(ty, a)
        if p is None:
            return None
        params.append(p)
    # The scratch pointers Triton's launcher appends (both since 3.5, the global one since 3.3): null.
    params += [("c", 8, 0)] * (hasattr(meta, "global_scratch_size") + hasattr(meta, "profile_scratch_size"))
    x, y, z = (*grid, 1, 1)[:3]
    # (clusters: Triton's launcher launches num_ctas programs a grid point along x, as the kernel's
    # compile-time cluster, which cuLaunchKernel keeps, groups them)
    return (function, (x * ctas, y, z), 32 * meta.num_warps, meta.shared, tuple(params))


def _cluster_in_kernel(compiled, ctas: int) -> bool:
    """Whether the kernel's clusters of ``ctas`` programs are its own (``.reqnctapercluster``, as
    ptx_cluster writes it), so that ``cuLaunchKernel`` launches them as Triton's launcher does with its
    cluster attribute."""
    try:
        ptx = compiled.asm["ptx"]
    except (KeyError, OSError):  # (a cache that keeps binaries only)
        return False
    return f".reqnctapercluster {ctas}, 1, 1" in ptx
