"""Launch plans replayed in C++ (kernels/csrc/replay.cpp, kernels/ops/native.py), without a GPU.

The extension is built here as on a GPU machine. Its launches go to a list instead of the driver
(``set_dry_run``), so what it would hand ``cuLaunchKernel`` is checked byte for byte: for our ops' real
kernels, compiled for sm_90 (kernels/ops/cross_compile.py), the parameters of a replay on new inputs are
the ones the op body launches with on those inputs, and their sizes are the kernel's PTX ``.param`` list.
The compiled checks run in a process of their own (this one runs Triton's interpreter, which compiles
nothing). Last, the launch path itself runs against a stand-in libcuda (``data/fake_libcuda.c``) that notes
what ``cuLaunchKernel`` and ``cuTensorMapEncodeTiled`` receive, read through the parameter array as the
driver reads it. On a GPU, tests/kernels/test_launch_plans.py and test_quant_matmul_gluon.py replay the
same plans for real.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys

import pytest
import torch

from squeezeserve.kernels.ops import native

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C++ compiler on this machine")


@pytest.fixture(scope="module")
def ext():
    module = native._import(native.build())
    log: list = []
    module.set_dry_run(log)
    yield module, log
    module.set_dry_run(None)


def _add_rmsnorm_like_plan(replayer, x, w, eps):
    """A plan of one launch reading x and w, writing out (and an address 16 bytes into it), with an i32, an
    fp32 and the two scratch pointers."""
    sig = [native.input_spec(a) for a in (x, w, eps)]
    params = (
        ("a", 0, 0),
        ("a", 3, 16),
        ("a", 1, 0),
        ("c", 4, 4096),
        ("c", 4, 0x3F800000),
        ("c", 8, 0),
        ("c", 8, 0),
    )
    replayer.add(sig, -1, [(tuple(x.shape), x.dtype, -1)], [(1234, (3, 1, 1), 256, 32, params)], True)


@pytest.fixture
def planned(ext):
    """A Replayer holding the plan above for x [3, 8], w [8], eps 1e-6; the dry-run log emptied."""
    module, log = ext
    replayer = module.Replayer(8)
    x, w = torch.randn(3, 8), torch.randn(8)
    _add_rmsnorm_like_plan(replayer, x, w, 1e-6)
    log.clear()
    return replayer, log, x, w


def test_a_replay_allocates_the_outputs_and_passes_the_call_s_addresses(planned):
    replayer, log, _, _ = planned
    x2, w2 = torch.randn(3, 8), torch.randn(8)  # new tensors, same signature
    out = replayer(x2, w2, 1e-6)
    assert out.shape == x2.shape and out.dtype == x2.dtype
    assert out.data_ptr() not in (x2.data_ptr(), w2.data_ptr())
    [(function, grid, block, shared, stream, params)] = log
    assert (function, grid, block, shared, stream) == (1234, (3, 1, 1), 256, 32, 0)
    addresses = [struct.unpack("<Q", p)[0] for p in (params[0], params[1], params[2])]
    assert addresses == [x2.data_ptr(), out.data_ptr() + 16, w2.data_ptr()]
    assert params[3] == struct.pack("<i", 4096) and params[4] == struct.pack("<f", 1.0)
    assert params[5:] == [bytes(8), bytes(8)]


def test_a_call_whose_signature_differs_anywhere_is_a_miss(planned):
    replayer, log, x, w = planned
    misses = [
        (torch.randn(4, 8), w, 1e-6),  # shape
        (x.double(), w, 1e-6),  # dtype
        (torch.randn(8, 3).t(), w, 1e-6),  # strides
        (torch.randn(25)[1:].view(3, 8), w, 1e-6),  # address not 16-byte aligned
        (x, w, 1e-5),  # a scalar's value
        (x, w, 1),  # a scalar's type
        (x, None, 1e-6),  # None for a tensor
        (x, w, "1e-6"),  # a kind no plan takes
        (x, w),  # arity
    ]
    for inputs in misses:
        assert replayer(*inputs) is None, inputs
    assert log == [] and len(replayer) == 1
    assert replayer(x, w, 1e-6) is not None and len(log) == 1


def test_calls_that_need_gradients_or_are_traced_take_the_python_path(planned):
    # (registry.eager's conditions, checked in the C call: the Python path then decides what to do)
    from torch.utils._python_dispatch import TorchDispatchMode

    replayer, log, x, w = planned

    class Sub(torch.Tensor):
        pass

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert replayer(x.clone().requires_grad_(), w, 1e-6) is None
    with torch.no_grad():
        assert replayer(x.clone().requires_grad_(), w, 1e-6) is not None
    assert replayer(x.as_subclass(Sub), w, 1e-6) is None
    assert replayer(x, torch.nn.Parameter(w, requires_grad=False), 1e-6) is not None  # (a module's weight)
    with Mode():
        assert replayer(x, w, 1e-6) is None
    inside_vmap = []
    torch.vmap(lambda row: inside_vmap.append(replayer(x, w, 1e-6)) or row)(torch.randn(2))
    assert inside_vmap == [None]
    assert len(log) == 2


def test_functional_calls_try_the_cpp_replay_first(planned, monkeypatch):
    from triton import knobs

    from squeezeserve.kernels.ops import replay

    replayer, log, x, w = planned
    plans = replay.LaunchPlans()
    assert plans.replayed(x, w, 1e-6) is None  # no extension yet: the usual path
    plans.native = replayer
    assert plans.replayed(x, w, 1e-6).shape == x.shape and len(log) == 1
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert plans.replayed(x, w, 1e-6) is None
    monkeypatch.undo()
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)  # a profiler's hook
    assert plans.replayed(x, w, 1e-6) is None
    assert len(log) == 1


def test_the_replayer_refuses_calls_while_a_launch_hook_is_set(planned):
    # The check is the extension's own (no Python frame a call): Triton's hook chains, added to and removed
    # from as proton does, and a hook assigned outright, as older code does.
    from triton import knobs

    replayer, log, x, w = planned
    seen = []
    for name in ("launch_enter_hook", "launch_exit_hook"):
        chain = getattr(knobs.runtime, name)
        chain.add(seen.append)
        try:
            assert replayer(x, w, 1e-6) is None
        finally:
            chain.remove(seen.append)
        assert replayer(x, w, 1e-6) is not None
    saved = knobs.runtime.launch_exit_hook
    knobs.runtime.launch_exit_hook = seen.append
    try:
        assert replayer(x, w, 1e-6) is None
    finally:
        knobs.runtime.launch_exit_hook = saved
    assert replayer(x, w, 1e-6) is not None and len(log) == 3


def test_compiled_code_does_not_guard_on_the_replayer(planned):
    # vLLM compiles its forward once; the replayer appears later, with an op's first plan. Compiled code must
    # not have read it: a guard on it would recompile (or, where vLLM skips guards, keep a stale branch).
    from squeezeserve.kernels.ops import replay

    replayer, log, x, w = planned
    plans = replay.LaunchPlans()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(t):
        out = plans.replayed(t, w, 1e-6)
        return t * 2 if out is None else out

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    assert torch.equal(compiled(x), x * 2)
    plans.native = replayer
    assert torch.equal(compiled(x), x * 2) and len(graphs) == 1
    assert plans.replayed(x, w, 1e-6) is not None and len(log) == 1  # (eagerly it replays)


def test_the_memo_starts_over_when_full_and_clears(ext):
    module, _ = ext
    replayer = module.Replayer(2)
    w = torch.randn(8)
    for rows in (1, 2, 3):
        _add_rmsnorm_like_plan(replayer, torch.randn(rows, 8), w, 1e-6)
    assert len(replayer) == 1  # the third plan found the memo full: it starts over with that one
    assert replayer(torch.randn(3, 8), w, 1e-6) is not None
    assert replayer(torch.randn(1, 8), w, 1e-6) is None
    replayer.clear()
    assert len(replayer) == 0 and replayer(torch.randn(3, 8), w, 1e-6) is None


def test_bad_plans_are_refused_with_a_reason(ext):
    module, _ = ext
    replayer = module.Replayer()
    x = torch.randn(3, 8)
    sig = [native.input_spec(x)]
    out = [((3, 8), x.dtype, -1)]
    with pytest.raises(ValueError, match="names tensor 5 of 2"):
        replayer.add(sig, -1, out, [(1, (1, 1, 1), 128, 0, (("a", 5, 0),))], True)
    with pytest.raises(ValueError, match="a constant of 3 bytes"):
        replayer.add(sig, -1, out, [(1, (1, 1, 1), 128, 0, (("c", 3, 0),))], True)
    with pytest.raises(ValueError, match="one output, or a tuple"):
        replayer.add(sig, -1, out * 2, [], True)
    with pytest.raises(TypeError, match="torch.dtype"):
        replayer.add(sig, -1, [((3, 8), "float32", -1)], [], True)
    assert len(replayer) == 0


def test_scalar_parameters_are_packed_as_triton_s_launcher_packs_them():
    assert native._constant("i32", -2) == ("c", 4, 0xFFFFFFFE)
    assert native._constant("i64", 2**40) == ("c", 8, 2**40)
    assert native._constant("i1", True) == ("c", 1, 1)
    assert native._constant("u8", 255) == ("c", 1, 255)
    assert native._constant("fp32", 1.0) == ("c", 4, 0x3F800000)
    assert native._constant("fp16", 1.0) == ("c", 2, 0x3C00)
    assert native._constant("bf16", 1.0) == ("c", 2, 0x3F80)
    assert native._constant("bf16", 1.005859375) == ("c", 2, 0x3F80)  # truncated (pack_bf16), not rounded
    assert native._constant("fp64", 0.5) == ("c", 8, 0x3FE0000000000000)
    assert native._constant("nvTmaDesc", 0) is None


def test_the_build_goes_where_the_environment_says(monkeypatch, tmp_path):
    monkeypatch.delenv("SQUEEZESERVE_NATIVE_DIR", raising=False)
    monkeypatch.setenv("SQUEEZESERVE_HOME", str(tmp_path / "home"))
    assert native.cache_dir() == tmp_path / "home" / "native"
    monkeypatch.setenv("SQUEEZESERVE_NATIVE_DIR", str(tmp_path / "image"))  # (an image's build)
    assert native.cache_dir() == tmp_path / "image"


def test_off_when_switched_off(monkeypatch):  # (SQUEEZESERVE_NATIVE_REPLAY=0)
    monkeypatch.setattr(native, "_loaded", [])
    monkeypatch.setattr(native, "NATIVE_REPLAY", False)
    assert native.load() is None


def test_a_failed_build_leaves_the_python_replay(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(native, "NATIVE_REPLAY", True)
    monkeypatch.setattr(native, "_compiler", lambda: None)
    monkeypatch.setattr(native, "_loaded", [])
    monkeypatch.setenv("SQUEEZESERVE_HOME", str(tmp_path))
    with caplog.at_level("WARNING"):
        assert native.load() is None
    assert "replay in Python (no C++ compiler found" in caplog.text
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler"):
        native.build(tmp_path)


# ---- our kernels, compiled for sm_90 -------------------------------------------------------------------

CASES = [
    "rmsnorm 16x4096",
    "add_rmsnorm 1x4096",
    "swiglu 16x14336",
    "silu_and_mul 16x28672",
    "softmax 16x32768",
    "softmax 16x131072",  # split rows: their scratch is the long-lived workspace (constants in the plan)
    "quant_matmul 1x14336x4096 int4 g128",
    "quant_matmul 16x14336x4096 int4 g128",
    "quant_matmul 16x4096x14336 int4 g32 zp",
    "quant_matmul 256x4096x4096 int4 g64",  # (the Triton prefill GEMM)
    # the Gluon kernel (TMA descriptors: tensor maps encoded for each call's addresses)
    "quant_matmul 32x4096x14336 int4 g128 (Gluon decode)",
    "quant_matmul 256x6144x4096 int4 g128 zp (Gluon prefill)",
    "quant_matmul 100x4096x14336 int4 g128 zp (Gluon stream-K)",
    "quant_matmul 128x4096x14336 int4 g128 zp (Gluon 64-row weight tiles, K in two parts)",
    # clusters of two programs sharing x (ptx_cluster: the kernel's own clusters, num_ctas 2)
    "quant_matmul 1024x4096x8192 int4 g128 (Gluon in clusters)",
    "quant_matmul 2048x14336x4096 int4 g128 (Gluon persistent in clusters)",
    # GLUON_TAIL: the first columns persistent in clusters, the last on 128-row tiles (views of the weight
    # and of y: descriptors at offsets into them)
    "quant_matmul 512x28672x4096 int4 g128 (Gluon persistent in clusters, a 128-row tail)",
]


@pytest.fixture(scope="module")
def compiled_checks(run_compiled) -> dict:
    return run_compiled([__file__, *CASES])


@pytest.mark.parametrize("case", CASES)
def test_a_replay_passes_what_the_body_launches_with(compiled_checks, case):
    result = compiled_checks[case]
    assert "error" not in result, result.get("error")
    assert result["launches"] >= 1
    for kernel, ptx_sizes, plan_sizes in result["sizes"]:
        assert plan_sizes == ptx_sizes, (
            f"{kernel}: parameter sizes {plan_sizes} against the PTX's {ptx_sizes}"
        )
    if "Gluon" in case:
        launches = 2 if "tail" in case else 1  # (GLUON_TAIL: two launches)
        assert [kernel for kernel, _, _ in result["params"]] == ["_wgmma_kernel"] * launches
    # the grid Triton's launcher launches: num_ctas programs a grid point along x (clusters of two here)
    assert result["grids"] and all(
        replayed == [recorded[0] * ctas, *recorded[1:]] for recorded, replayed, ctas in result["grids"]
    ), result["grids"]
    assert [ctas for _, _, ctas in result["grids"]] == (
        [2, 1] if "tail" in case else [2] if "clusters" in case else [1] * result["launches"]
    )
    for kernel, expected, replayed in result["params"]:
        assert replayed == expected, f"{kernel}: replayed parameters differ from the body's launch"


# ---- the check itself (run as a script, without the interpreter) ---------------------------------------

_PTX_PARAM = re.compile(
    r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)(?:\s+\.ptr\s+\.\w+\s+\.align\s+\d+)?\s+\w+(\[(\d+)\])?"
)
_PTX_BYTES = {"u64": 8, "b64": 8, "s64": 8, "f64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4, "u16": 2,
              "b16": 2, "s16": 2, "f16": 2, "u8": 1, "b8": 1, "s8": 1}  # fmt: skip


def _ptx_param_sizes(compiled) -> list[int]:
    entry = re.search(r"\.entry\s+\w+\s*\((.*?)\)", compiled.asm["ptx"], re.S)
    sizes = []
    for ty, _, count in _PTX_PARAM.findall(entry.group(1) if entry else ""):
        sizes.append(_PTX_BYTES[ty] * (int(count) if count else 1))
    return sizes


def _spec_sizes(params) -> list[int]:
    return [8 if p[0] == "a" else 128 if p[0] == "m" else p[1] for p in params]


def _case(name: str):
    from squeezeserve.kernels import quant_layout
    from squeezeserve.kernels.ops import quant_matmul, rmsnorm, softmax, swiglu

    bf16 = torch.bfloat16
    shape = [int(v) for v in name.split()[1].split("x")]
    if name.startswith("quant_matmul"):
        m, n, k = shape
        group = int(re.search(r" g(\d+)", name).group(1))
        zp = " zp" in name

        def make():
            t = quant_layout.pack_weight(torch.randn(n, k) / 64, 4, group, symmetric=not zp)
            zeros = t.get("weight_zero_point")
            return (torch.randn(m, k, dtype=bf16), t["weight_packed"], t["weight_scale"].to(bf16),
                    zeros, group, 4)  # fmt: skip

        return quant_matmul._quant_matmul, make, quant_matmul.workspace_buffers
    rows, cols = shape

    def t(*size):
        return torch.randn(*size, dtype=bf16)

    makes = {
        "rmsnorm": (rmsnorm._rmsnorm, lambda: (t(rows, cols), t(cols).abs(), 1e-6)),
        "add_rmsnorm": (rmsnorm._add_rmsnorm, lambda: (t(rows, cols), t(rows, cols), t(cols).abs(), 1e-5)),
        "swiglu": (swiglu._swiglu, lambda: (t(rows, cols), t(rows, cols))),
        "silu_and_mul": (swiglu._silu_and_mul, lambda: (t(rows, cols),)),
        "softmax": (softmax._softmax, lambda: (t(rows, cols),)),
    }
    body, make = makes[name.split()[0]]
    return body, make, softmax.workspace_buffers if name.startswith("softmax") else lambda: ()


def _captured(body, inputs):
    from squeezeserve.kernels.ops import launch, replay

    views = replay._OnlyViews()
    with launch.capture() as launches, views:
        result = body(*inputs)
    return result, launches, views.other


def _triton_tensor_map(descriptor, meta: dict, replayed_address) -> list:
    """The parameters Triton's launcher makes of a host TMA descriptor (its ``make_tensordesc_arg``, with
    the driver's ``fill_tma_descriptor`` noting its arguments instead of encoding): the map as
    ``cuTensorMapEncodeTiled`` takes it (what ``fillTMADescriptor`` computes: innermost dimension first,
    strides in bytes), then the shape's i32s and the strides' i64s."""
    import inspect

    import triton
    from triton.backends.nvidia import driver as nvidia

    noted = []

    class Utils:
        def fill_tma_descriptor(self, *args):  # (Triton 3.6's name; 3.9's below)
            noted.append(args)
            return "map"

        fill_tma_descriptor_tiled = fill_tma_descriptor

    class Driver:
        utils = Utils()

    config = triton.runtime.driver
    saved = getattr(config, "_active", None)  # (no GPU: reset_active() would look for one)
    config.set_active(Driver())
    try:
        extra = [None] * (len(inspect.signature(nvidia.make_tensordesc_arg).parameters) - 2)
        made = nvidia.make_tensordesc_arg(descriptor, meta, *extra)
    finally:
        config.set_active(saved)
    [(address, swizzle, elem_size, elem_type, block, shape, strides, padding)] = noted
    encode = [replayed_address(address), elem_type, list(shape[::-1]),
              [elem_size * v for v in strides[:-1]][::-1], list(block[::-1]), swizzle, padding]  # fmt: skip
    rank = len(shape)
    assert made[0] == "map" and len(made) == 1 + 2 * rank
    return [encode, *(struct.pack("<i", v).hex() for v in made[1 : 1 + rank]),
            *(struct.pack("<q", v).hex() for v in made[1 + rank :])]  # fmt: skip


def _check(name: str) -> dict:
    from squeezeserve.kernels.ops import cross_compile, launch, replay

    native.NATIVE_REPLAY = True  # (descriptor launches are planned only with it)

    body, make, persistent = _case(name)
    _captured(body, make())  # (a first call may allocate what later calls reuse: quant_matmul's workspace)
    inputs = make()
    result, launches, other = _captured(body, inputs)
    recorded, sizes = [], []
    for kernel, grid, args, kwargs in launches:
        compiled = cross_compile.compile_for(kernel, args, kwargs)
        tail = launch.FastLaunch(kernel).tail(len(args), kwargs)
        run = launch.CompiledLaunch((None, 1000 + len(recorded), None, tail, compiled), -1, grid)
        recorded.append((run, args))
    plan = replay._build(inputs, result, recorded, other, persistent())
    if plan is None:
        return {"case": name, "error": "the body's launches made no plan"}
    outs = [result] if plan.single else list(result)
    spec = replay._native_spec(plan, inputs, outs, -1)
    if spec is None:
        return {"case": name, "error": "the plan has no native form"}
    for (run, _), described in zip(plan.launches, spec[3], strict=True):
        sizes.append((run.compiled.name, _ptx_param_sizes(run.compiled), _spec_sizes(described[4])))

    # Replay on new inputs of the same signature, and capture the body on them: the same parameters, with
    # the replay's own outputs where the body's launch wrote into the outputs it allocated.
    module = native._import(native.build())
    replayer = module.Replayer()
    replayer.add(*spec)
    new_inputs = make()
    log: list = []
    module.set_dry_run(log)
    try:
        replayed = replayer(*new_inputs)
    finally:
        module.set_dry_run(None)
    if replayed is None:
        return {"case": name, "error": "the replayer missed the signature it was given"}
    body_result, body_launches, _ = _captured(body, new_inputs)
    body_outs = [body_result] if plan.single else list(body_result)
    replay_outs = [replayed] if plan.single else list(replayed)
    params, grids = [], []
    for (kernel, grid, args, kwargs), (run, _), entry in zip(body_launches, plan.launches, log, strict=True):
        grids.append(([*grid, 1, 1][:3], list(entry[1]), run.compiled.metadata.num_ctas))
        tail = launch.FastLaunch(kernel).tail(len(args), kwargs)

        def replayed_address(address):
            for body_out, replay_out in zip(body_outs, replay_outs, strict=True):
                start, end = replay._extent(body_out)
                if start <= address < end or address == start:
                    return replay_out.data_ptr() + address - start
            return address

        expected = []
        maps = iter(getattr(run.compiled.metadata, "tensordesc_meta", None) or ())
        for ty, a in zip(run.compiled.src.signature.values(), [*args, *tail], strict=True):
            if ty == "constexpr":
                continue
            if ty.startswith("tensordesc"):
                expected += _triton_tensor_map(a, next(maps), replayed_address)
            elif isinstance(a, torch.Tensor):
                expected.append(struct.pack("<Q", replayed_address(a.data_ptr())).hex())
            else:
                constant = native._constant(ty, a)
                expected.append(constant[2].to_bytes(constant[1], "little").hex())
        scratch = len(entry[5]) - len(expected)
        expected += [bytes(8).hex()] * scratch
        replayed_params = [list(p) if isinstance(p, tuple) else p.hex() for p in entry[5]]
        params.append((run.compiled.name, expected, replayed_params))
    return {"case": name, "launches": len(plan.launches), "sizes": sizes, "params": params, "grids": grids}


if __name__ == "__main__":
    for case in sys.argv[1:]:
        try:
            out = _check(case)
        except Exception as e:  # noqa: BLE001 - reported per case, the test names it
            out = {"case": case, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)  # noqa: T201


# ---- through the driver's entry points (a stand-in libcuda, in a process of its own) -------------------

_THROUGH_DRIVER = r"""
import ctypes, struct, sys
import torch
from squeezeserve.kernels.ops import native

fake = ctypes.CDLL("libcuda.so.1")  # the stand-in (LD_LIBRARY_PATH): the one the extension opens
fake.fake_param.restype = fake.fake_launch_arg.restype = ctypes.c_uint64
module = native._import(native.build())
x, w = torch.randn(4, 64), torch.randn(64)
sig = [native.input_spec(a) for a in (x, w, 0.5)]
tensor_map = ("m", 0, 128, 9, (64, 4), (256,), (32, 2), 3, 0)  # x from its second row: box 2 x 32
params = (tensor_map, ("a", 3, 0), ("a", 1, 4), ("c", 4, 64), ("c", 2, 0x3800), ("c", 8, 0))
replayer = module.Replayer()
replayer.add(sig, -1, [((4, 64), torch.float32, -1)], [(0x1234, (2, 3, 1), 128, 4096, params)], True)
maps = (ctypes.c_int * 1)(0)
fake.fake_expect_params(len(params), maps, 1)
x2, w2 = torch.randn(4, 64), torch.randn(64)
out = replayer(x2, w2, 0.5)
words = [fake.fake_param(0, i) for i in range(16)]
checks = {
    "launched once": fake.fake_launches() == 1,
    "function, grid, block, shared, null stream": [fake.fake_launch_arg(i) for i in range(9)]
    == [0x1234, 2, 3, 1, 128, 1, 1, 4096, 0],
    "map: address, dtype, no interleave, L2 128B": words[:2] == [x2.data_ptr() + 128, 9 | (2 << 40)],
    "map: rank, dims, strides, box (unit element strides)": (words[2], words[3:5], words[7:9], words[11:13])
    == (2, [64, 4], [256, 0], [32 | (1 << 32), 2 | (1 << 32)]),
    "map: swizzle, fill": words[15] == 3,
    "addresses": [fake.fake_param(1, 0), fake.fake_param(2, 0)] == [out.data_ptr(), w2.data_ptr() + 4],
    "constants": [fake.fake_param(i, 0) & m for i, m in ((3, 0xFFFFFFFF), (4, 0xFFFF), (5, 2**64 - 1))]
    == [64, 0x3800, 0],
}
bad = module.Replayer()
bad.add(sig, -1, [((4, 64), torch.float32, -1)], [(0xDEAD, (1, 1, 1), 32, 0, (("c", 8, 0),))], True)
try:
    bad(x2, w2, 0.5)
    checks["a failed launch raises"] = False
except RuntimeError as e:
    checks["a failed launch raises"] = "CUDA error 700: fake illegal address" in str(e)
print({k: v for k, v in checks.items() if not v} or "ok")
"""


def test_a_replay_hands_the_driver_its_parameters(tmp_path):
    # What cuLaunchKernel and cuTensorMapEncodeTiled receive, read through the parameter array as the driver
    # reads it; a launch the driver refuses raises with its error string.
    cc = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if cc is None:
        pytest.skip("no C compiler to build the stand-in driver")
    source = os.path.join(os.path.dirname(__file__), "data", "fake_libcuda.c")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", source, "-o", str(tmp_path / "libcuda.so.1")], check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    done = subprocess.run([sys.executable, "-c", _THROUGH_DRIVER], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ok", done.stdout
