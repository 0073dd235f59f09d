import pytest
import torch
import triton
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from squeezeserve.kernels.ops import launch
from squeezeserve.kernels.ops.launch import (
    Workspace,
    block_rows,
    cdiv,
    next_power_of_2,
    persistent_programs,
    specialization_key,
    traceable,
)


def test_host_launch_arithmetic_matches_triton():
    # The launchers use plain-Python twins of Triton's constexpr functions (cheaper on the host); the
    # grids and block sizes they compute must be Triton's.
    for n in [*range(0, 4100), 14336, 65535, 65536, 65537, 131072, 2**31 - 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in [*range(0, 300), 4096, 14336, 131071]:
        for b in (1, 2, 3, 7, 16, 128, 256, 16384):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_row_count_arithmetic_adds_no_guard_on_a_symbolic_row_count():
    # vLLM compiles one graph for every batch size, tracing our triton_ops' launchers with a symbolic row
    # count; a guard on it (a branch, a power-of-two rounding) specialises the graph to the size traced,
    # and vLLM refuses to start ("marked ... as dynamic but your code specialized it", seen on the H100 at
    # max_num_batched_tokens 8192). An unbacked symbol raises on any guard.
    rows = ShapeEnv().create_unbacked_symint()
    for block in (64, 1024, 4096):
        assert isinstance(block_rows(rows, block), int)
        cdiv(rows, block_rows(rows, block))
    assert persistent_programs(torch.device("cpu"), rows) == 4
    # and concrete counts keep their tiles
    assert (
        block_rows(3, 64) == 4 and block_rows(1, 64) == 1 and persistent_programs(torch.device("cpu"), 2) == 2
    )


def test_specialization_key_separates_what_triton_specializes_on():
    # A launch reuses a compiled kernel only when Triton would have picked the same one: a pointer's
    # 16-byte alignment, an int equal to 1 or divisible by 16, an int's width and every constexpr are
    # compiled into it (the kernel assumes them), so each must change the key.
    base = torch.zeros(64, dtype=torch.bfloat16)
    key = lambda *args, **kw: specialization_key(args, kw)  # noqa: E731
    assert key(base, 4096, BLOCK=64) == key(torch.ones(64, dtype=torch.bfloat16), 8192, BLOCK=64)
    assert key(base, 4096) != key(base[1:], 4096)  # 2 bytes past an aligned address
    assert key(base, 4096) != key(base.float(), 4096)
    assert key(base, 16) != key(base, 17) != key(base, 1)
    assert key(base, 17) == key(base, 19)
    assert key(base, 2**31 - 16) != key(base, 2**31)  # int32 -> int64 argument
    assert key(base, 1.0) != key(base, 1) and key(base, True) != key(base, 1)
    assert key(base, None) != key(base, 0)
    assert key(base, BLOCK=64) != key(base, BLOCK=128)
    assert key(base, BLOCK=64, num_warps=4) != key(base, BLOCK=64, num_warps=8)
    assert key(base, (1, 2)) is None  # tuples (and anything else): Triton's own launch
    # a constexpr passed by position is compiled in by value, like one passed by keyword
    assert specialization_key((base, 64), {}, frozenset({1})) != specialization_key(
        (base, 128), {}, frozenset({1})
    )
    assert key(base, 64) == key(base, 128)  # as a plain int both are "a multiple of 16"


def test_specialization_key_of_tma_descriptors():
    # A Gluon kernel's TMA descriptors: the same compiled kernel serves any tensor of the same dtype and
    # alignment through the same block and layout; shapes and strides count as Triton's ints do.
    gluon = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from squeezeserve.kernels.ops.quant_matmul_gluon import _smem_layout

    def desc(x, block=(16, 256)):
        return gluon.TensorDescriptor.from_tensor(x, list(block), _smem_layout(*block, x.dtype))

    x = torch.zeros(32, 4096, dtype=torch.bfloat16)
    key = lambda *args: specialization_key(args, {"MODE": 2})  # noqa: E731
    assert key(desc(x)) == key(desc(torch.ones(32, 4096, dtype=torch.bfloat16)))
    assert key(desc(x[:17])) == key(desc(x[:31])) != key(desc(x[:16]))  # 17 rows as 31; not 16
    assert key(desc(x)) != key(desc(x, (16, 128)))  # another block (and layout)
    assert key(desc(x)) != key(desc(x.half()))
    assert hash(key(desc(x)))


def test_interpreted_and_traced_launches_bypass_the_fast_path():
    from torch._library.triton import set_wrap_triton_enabled

    from squeezeserve.kernels.ops import launch
    from squeezeserve.kernels.ops.swiglu import _swiglu_fwd

    with set_wrap_triton_enabled(False):
        fast = traceable(_swiglu_fwd)
    if launch.interpreting():
        assert fast is _swiglu_fwd
    else:
        assert isinstance(fast, launch.FastLaunch) and traceable(_swiglu_fwd) is not fast
    names = _swiglu_fwd.arg_names
    assert {names[i] for i in launch.FastLaunch(_swiglu_fwd).constexpr_positions} == {
        "BLOCK_R",
        "BLOCK",
        "OAI",
        "LAUNCH_DEPENDENTS",
        "WAIT",
    }
    with set_wrap_triton_enabled(True):
        assert not isinstance(traceable(_swiglu_fwd), launch.FastLaunch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled launches need a GPU")
def test_fast_launches_compute_what_tritons_launch_computes():
    # Each op twice through Triton's dispatch and twice through the fast path (the first fast call
    # compiles through Triton and caches; the second launches directly), on an aligned tensor and on one
    # starting 2 bytes in (its own specialization: a kernel compiled for aligned pointers would use
    # 16-byte loads on it).
    import squeezeserve.kernels as K
    from squeezeserve.kernels.ops import launch
    from squeezeserve.kernels.ops.softmax import _softmax_fwd

    calls = {
        "swiglu": lambda a, b: K.swiglu(a, b),
        "rmsnorm": lambda a, b: K.rmsnorm(a, b[0], 1e-6),
        "add_rmsnorm": lambda a, b: K.add_rmsnorm(a, b, b[0], 1e-6)[0],
        "softmax": lambda a, b: K.softmax(a),
        "silu_and_mul": lambda a, b: K.silu_and_mul(torch.cat([a, b], -1)),
    }
    for rows, n in ((1, 4096), (16, 4096), (5, 1000)):
        full = torch.randn(rows, n + 8, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        for a in (full[:, :n].contiguous(), full.view(-1)[1 : 1 + rows * n].view(rows, n)):
            for name, call in calls.items():
                launch.FAST_LAUNCH = False
                try:
                    expected = call(a, b)
                finally:
                    launch.FAST_LAUNCH = True
                for _ in range(2):
                    torch.testing.assert_close(call(a, b), expected, rtol=0, atol=0, msg=name)
    assert launch._FAST[_softmax_fwd].compiled  # the fast path cached what it launched


def test_fewer_stages_only_for_shared_memory():
    from triton.runtime.errors import OutOfResources

    smem = OutOfResources(149504, 101376, "shared memory")
    assert launch.fewer_stages({"num_stages": 4, "BLOCK": 64}, smem) == {"num_stages": 3, "BLOCK": 64}
    assert launch.fewer_stages({}, smem) == {"num_stages": launch.DEFAULT_STAGES - 1}  # Triton's default
    assert launch.fewer_stages({"num_stages": 1}, smem) is None  # nothing left to take away
    assert launch.fewer_stages({"num_stages": 4}, OutOfResources(2048, 1024, "threads")) is None
    assert launch.fewer_stages({"num_stages": 4}, RuntimeError("other")) is None


class _SmallGpu:
    """Stands in for Triton's launch of a kernel on a GPU whose shared memory holds ``fits`` stages: loading
    the kernel at more raises what Triton raises (no GPU here to raise it)."""

    def __init__(self, fits: int):
        self.fits, self.tried = fits, []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            from triton.runtime.errors import OutOfResources

            stages = kwargs.get("num_stages", launch.DEFAULT_STAGES)
            self.tried.append(stages)
            if stages > self.fits:
                raise OutOfResources(stages * 50_000, self.fits * 50_000, "shared memory")
            return ("compiled", stages, args)

        return run


def test_launch_fitting_takes_stages_away_until_the_kernel_fits():
    gpu = _SmallGpu(fits=2)
    assert launch.launch_fitting(gpu, (4,), (1, 2), {"num_stages": 4, "BLOCK": 8}) == ("compiled", 2, (1, 2))
    assert gpu.tried == [4, 3, 2]
    gpu = _SmallGpu(fits=0)  # not even one stage: Triton's error, as it was
    with pytest.raises(Exception, match="shared memory"):
        launch.launch_fitting(gpu, (4,), (), {})
    assert gpu.tried == [3, 2, 1]


def test_fast_launch_fits_the_gpu_on_triton_s_own_path(monkeypatch):
    # (the cached path needs CUDA; Triton's own path, which every first launch of a key takes, runs here)
    gpu = _SmallGpu(fits=2)
    gpu.fn = lambda x, n, BLOCK: None  # noqa: E731 - the kernel's signature, as FastLaunch reads it
    gpu.arg_names = ["x", "n", "BLOCK"]
    monkeypatch.setattr(launch, "FAST_LAUNCH", False)
    assert launch.FastLaunch(gpu)[(4,)](1, 2, BLOCK=8, num_stages=4) == ("compiled", 2, (1, 2))
    assert gpu.tried == [4, 3, 2]


def test_workspace_grows_geometrically_and_keeps_what_it_replaced():
    """Sizes asked in growing order (a server's row counts as they come): each set is at least as large as
    asked and zero, the replaced sets stay alive (plans and graphs point at them), and all of them together
    hold at most about twice the largest set, not the sum of every size asked."""
    ws = Workspace((torch.float32, 16), (torch.int32, 4))
    device = torch.device("cpu")
    first = ws(device, 1, 1)
    for n in range(1, 1001):
        floats, counts = ws(device, n, 3)
        assert floats.numel() >= n and counts.numel() >= 4
        assert not floats.any() and not counts.any()
    assert ws(device, 10, 2)[0] is floats  # (no smaller size replaces a set)
    assert any(first[0] is group[0] for group in ws.retired)
    kept = sum(group[0].numel() for group in (*ws.retired, (floats,)))
    assert floats.numel() < 2 * 1000
    assert kept < 4 * 1000  # (growing to each size asked kept 500500)
    assert len(ws.retired) <= 7  # 16 -> 32 -> ... -> 1024


def test_traced_launches_let_no_dependent_start_and_pass_their_output_once(monkeypatch):
    # torch.compile decomposes a triton_op into its launches (through wrap_triton) and gives a kernel whose
    # writes its analysis cannot follow (inline PTX) a copy of each argument, taking an argument passed
    # twice back from its last copy. So a traced launch leaves launch_dependents' PTX out (nothing launches
    # as its dependent) and passes no output again as an unused workspace (H200: quant_matmul under
    # torch.compile returned that unwritten copy; tests/benchmarks/NOTES.md, forty-second session).
    from torch._library.triton import set_wrap_triton_enabled
    from torch.utils._python_dispatch import TorchDispatchMode

    class Tracing(TorchDispatchMode):  # (runs each op as it comes: to registry.eager, a trace)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(launch.recording, "target", (132, True))  # (a Hopper GPU's launches, as capture has)
    x = torch.zeros(4, 8, dtype=torch.float16)
    with set_wrap_triton_enabled(False):  # an eager call (registry.direct_launches)
        assert launch.lets_dependents_start(x) and not launch.traced(x)
        ws, counts = launch.no_workspace(x)
        assert ws is x and counts is x
    # launches through wrap_triton outside a trace (the opaque ops' bodies while vLLM captures its graphs)
    with set_wrap_triton_enabled(True):
        assert launch.lets_dependents_start(x) and not launch.traced(x)
        with Tracing():
            assert launch.traced(x) and not launch.lets_dependents_start(x)
            ws, counts = launch.no_workspace(x)
        assert ws is not x and counts is not x and ws.numel() == counts.numel() == 0
