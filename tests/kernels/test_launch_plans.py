"""Eager launch plans (kernels/ops/replay.py): a call without gradients records its op body's launches once
per input signature, later calls replay them. Under the interpreter the recorded launches are the
interpreter's kernels, so these tests replay the real kernels on CPU tensors."""

import dataclasses

import pytest
import torch

from squeezeserve.kernels import functional as K
from squeezeserve.kernels import registry
from squeezeserve.kernels.ops import native, replay
from squeezeserve.kernels.ops import rmsnorm as rmsnorm_op
from squeezeserve.kernels.ops import softmax as softmax_op
from squeezeserve.kernels.ops import swiglu as swiglu_op

_ops = torch.ops.squeezeserve
EPS = 1e-6

# (eager op, registered op, inputs on a device): the eager op's body recorded, then replayed on new inputs.
CASES = {
    "swiglu": (
        swiglu_op.swiglu_eager,
        _ops.swiglu,
        lambda d: (torch.randn(3, 37, device=d), torch.randn(3, 37, device=d)),
    ),
    "swiglu_oai": (
        swiglu_op.swiglu_oai_eager,
        _ops.swiglu_oai,
        lambda d: (torch.randn(2, 5, 16, device=d), torch.randn(2, 5, 16, device=d), 1.702, 2.0),
    ),
    # the up half is a kernel argument 37 elements into the input: an offset view in the plan
    "silu_and_mul": (
        swiglu_op.silu_and_mul_eager,
        _ops.silu_and_mul,
        lambda d: (torch.randn(3, 74, device=d),),
    ),
    "rmsnorm": (
        rmsnorm_op.rmsnorm_eager,
        _ops.rmsnorm,
        lambda d: (torch.randn(4, 37, dtype=torch.bfloat16, device=d), torch.rand(37, device=d) + 0.5, EPS),
    ),
    "add_rmsnorm": (
        rmsnorm_op.add_rmsnorm_eager,
        _ops.add_rmsnorm,
        lambda d: (
            torch.randn(3, 37, device=d),
            torch.randn(3, 37, device=d),
            torch.rand(37, device=d) + 0.5,
            EPS,
        ),
    ),
    "softmax": (softmax_op.softmax_eager, _ops.softmax, lambda d: (torch.randn(5, 300, device=d),)),
}


class Counting:
    """An op body that counts its runs (replays do not run it)."""

    def __init__(self, body):
        self.body, self.runs = body, 0

    def __call__(self, *inputs):
        self.runs += 1
        return self.body(*inputs)


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.fixture
def fresh_plans():
    """Each op's memo emptied before and after a test (plans are per process)."""
    for op, _, _ in CASES.values():
        op.plans.clear()
    yield
    for op, _, _ in CASES.values():
        op.plans.clear()


@pytest.mark.parametrize("name", CASES)
def test_replay_equals_the_registered_op_on_new_inputs(name, device, fresh_plans):
    op, registered, make = CASES[name]
    body = Counting(op.forward)
    with torch.no_grad():
        first = make(device)
        recorded = op.plans(body, first)
        assert len(op.plans.plans) == 1 and isinstance(next(iter(op.plans.plans.values())), replay._Plan)
        for _ in range(2):
            inputs = make(device)  # new tensors (and addresses), same signature
            replayed = op.plans(body, inputs)
            expected = registered(*inputs)
            # The same kernels on the same inputs: bit-identical outputs.
            for a, b in zip(_outputs(replayed), _outputs(expected), strict=True):
                assert torch.equal(a, b)
                assert all(a.data_ptr() != t.data_ptr() for t in inputs if isinstance(t, torch.Tensor))
    assert body.runs == 1, "the body ran again where the plan should have replayed"
    for a, b in zip(_outputs(recorded), _outputs(registered(*first)), strict=True):
        assert torch.equal(a, b)


@pytest.fixture
def cpp_replay(monkeypatch):
    """The C++ replay on (kernels/ops/native.py; off by default until measured on a GPU)."""
    monkeypatch.setattr(native, "NATIVE_REPLAY", True)
    monkeypatch.setattr(native, "_loaded", [])
    if native.load() is None:
        pytest.fail("the replay extension did not build (the log says why)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the C++ replay launches on a GPU")
@pytest.mark.parametrize("name", CASES)
def test_the_cpp_replay_equals_the_registered_op(name, device, fresh_plans, cpp_replay):
    op, registered, make = CASES[name]
    body = Counting(op.forward)
    with torch.no_grad():
        op.plans(body, make(device))
        assert op.plans.native is not None and len(op.plans.native) == 1
        for _ in range(2):
            inputs = make(device)
            replayed = op.plans.native(*inputs)
            assert replayed is not None, "the C++ replayer missed the recorded signature"
            for a, b in zip(_outputs(replayed), _outputs(registered(*inputs)), strict=True):
                assert torch.equal(a, b)
        assert op.plans(body, make(device)) is not None and body.runs == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the C++ replay launches on a GPU")
@pytest.mark.parametrize("m", [1, 5, 70, 264], ids=["fma", "skinny-split", "prefill-split", "row-split"])
def test_the_cpp_replay_of_quant_matmul_equals_its_body(m, device, monkeypatch, cpp_replay):
    # (row-split: the prefill writes the output's first 256 rows, a decode kernel the rest: one plan)
    from squeezeserve.kernels.ops import quant_matmul as qm

    monkeypatch.setattr(qm, "PREFILL", "triton")
    monkeypatch.setattr(qm, "ROW_SPLIT", "on")
    plans = replay.LaunchPlans(persistent=qm.workspace_buffers)
    qweight, scales = _packed_weight(40, 256, 32, device)
    with torch.no_grad():
        with registry.direct_launches:  # (the workspace made first, as below)
            qm._quant_matmul(torch.randn(m, 256, device=device).half(), qweight, scales, None, 32, 4)
        plans(qm._quant_matmul, (torch.randn(m, 256, device=device).half(), qweight, scales, None, 32, 4))
        assert plans.native is not None and len(plans.native) == 1
        for _ in range(3):
            x = torch.randn(m, 256, device=device).half()
            got = plans.native(x, qweight, scales, None, 32, 4)
            with registry.direct_launches:
                expected = qm._quant_matmul(x, qweight, scales, None, 32, 4)
            assert got is not None and torch.equal(got, expected)
    assert all(not t.any() for t in qm.workspace_buffers()), "a replay left partial sums in the workspace"


def test_functional_calls_without_gradients_go_through_the_plans(device, fresh_plans):
    x = torch.randn(6, 40, device=device)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(K.softmax(x), _ops.softmax(x))
    assert len(softmax_op.softmax_eager.plans.plans) == 1


def test_softmax_plans_replay_split_rows_through_the_workspace(device, fresh_plans):
    # Rows wider than one block meet in the split path's long-lived workspace, which softmax_eager's plans
    # hold as a constant: the body runs once, replays equal its launches bit for bit and leave it zero.
    op = softmax_op.softmax_eager
    body = Counting(op.forward)
    shape = (2, softmax_op.SINGLE_BLOCK_COLS + 3616)  # 9 chunks, the last ragged
    with torch.no_grad():
        with registry.direct_launches:  # the workspace made first: making it is a fill, which no plan repeats
            softmax_op._softmax(torch.randn(shape, device=device))
        for _ in range(3):
            x = torch.randn(shape, device=device)
            got = op.plans(body, (x,))
            with registry.direct_launches:
                expected = softmax_op._softmax(x)
            assert torch.equal(got, expected)
    assert body.runs == 1, "the body ran again where the plan should have replayed"
    assert isinstance(next(iter(op.plans.plans.values())), replay._Plan)
    assert all(not t.any() for t in softmax_op.workspace_buffers()), "a replay left scratch in the workspace"


def test_a_new_signature_records_a_new_plan(device, fresh_plans):
    op = rmsnorm_op.rmsnorm_eager
    w = torch.rand(32, device=device) + 0.5
    with torch.no_grad():
        for rows in (1, 16, 1):
            x = torch.randn(rows, 32, device=device)
            assert torch.equal(op(x, w, EPS), _ops.rmsnorm(x, w, EPS))
        op(torch.randn(1, 32, device=device), w, 1e-5)  # another eps: another signature
        op(torch.randn(1, 32, dtype=torch.float16, device=device), w, EPS)  # another dtype
    assert len(op.plans.plans) == 4


def test_aliased_inputs_replay_a_plan_recorded_without_aliasing(device, fresh_plans):
    op = rmsnorm_op.add_rmsnorm_eager
    w = torch.rand(37, device=device) + 0.5
    with torch.no_grad():
        op(torch.randn(3, 37, device=device), torch.randn(3, 37, device=device), w, EPS)
        x = torch.randn(3, 37, device=device)
        y, h = op(x, x, w, EPS)  # x + x
    expected_y, expected_h = _ops.add_rmsnorm(x, x.clone(), w, EPS)
    assert torch.equal(y, expected_y) and torch.equal(h, expected_h)


def test_a_call_with_aliased_inputs_records_no_plan(device, fresh_plans):
    # Recorded on x + x, a plan could hand a later call's x to the kernel as its residual too.
    op = rmsnorm_op.add_rmsnorm_eager
    w = torch.rand(37, device=device) + 0.5
    with torch.no_grad():
        x = torch.randn(3, 37, device=device)
        op(x, x, w, EPS)
        assert op.plans.plans == {}
        a, b = torch.randn(3, 37, device=device), torch.randn(3, 37, device=device)
        for _ in range(2):  # records, then replays
            y, h = op(a, b, w, EPS)
            expected_y, expected_h = _ops.add_rmsnorm(a, b, w, EPS)
            assert torch.equal(y, expected_y) and torch.equal(h, expected_h)
    assert isinstance(next(iter(op.plans.plans.values())), replay._Plan)


def test_bodies_a_replay_could_not_repeat_run_every_call(device, fresh_plans):
    op = softmax_op.softmax_eager
    with torch.no_grad():
        # A non-contiguous row: the body copies it first (a torch op that is not a view).
        x = torch.randn(40, 6, device=device).t()
        for _ in range(replay.RECORD_ATTEMPTS + 1):
            assert torch.equal(op(x), _ops.softmax(x.contiguous()))
        assert list(op.plans.plans.values()) == [replay.RECORD_ATTEMPTS]
        # A body that writes into its output after the launch.
        body = Counting(lambda t: softmax_op._softmax(t).mul_(2))
        y = torch.randn(3, 8, device=device)
        for _ in range(3):
            assert torch.equal(op.plans(body, (y,)), 2 * _ops.softmax(y))
    assert body.runs == 3


def test_bad_input_raises_and_records_nothing(device, fresh_plans):
    op = rmsnorm_op.rmsnorm_eager
    with torch.no_grad(), pytest.raises(ValueError, match="rmsnorm"):
        op(torch.randn(2, 8, device=device), torch.rand(7, device=device), EPS)
    assert op.plans.plans == {}


def test_calls_with_gradients_and_reference_calls_keep_out_of_the_plans(device, fresh_plans):
    x = torch.randn(3, 37, device=device, requires_grad=True)
    K.softmax(x).sum().backward()
    assert x.grad is not None and softmax_op.softmax_eager.plans.plans == {}
    with registry.triton_on_cpu(False), torch.no_grad():
        K.softmax(x.detach().cpu())  # CPU tensors outside triton_on_cpu: the reference
    assert softmax_op.softmax_eager.plans.plans == {}


def test_the_memo_starts_over_when_full(device, fresh_plans, monkeypatch):
    monkeypatch.setattr(replay, "MAX_PLANS", 2)
    op = swiglu_op.swiglu_eager
    with torch.no_grad():
        for rows in (1, 2, 3):
            a, b = torch.randn(rows, 8, device=device), torch.randn(rows, 8, device=device)
            assert torch.equal(op(a, b), _ops.swiglu(a, b))
    assert len(op.plans.plans) == 1


# --- quant_matmul's serving calls (vLLM's eager prompt forwards) ------------------------------------------


def _packed_weight(n: int, k: int, group: int, device: str):
    from squeezeserve.kernels import quant_layout as ql

    tensors = ql.pack_weight(torch.randn(n, k).half(), 4, group)  # fp16: fp32 activations take the reference
    return tensors["weight_packed"].to(device), tensors["weight_scale"].to(device)


@pytest.mark.parametrize("m", [1, 5, 70], ids=["fma", "skinny-split", "prefill-split"])
def test_quant_serving_plans_replay_split_k_through_the_workspace(m, device, monkeypatch):
    # The serving path of quant_matmul (quant_matmul_eager: vLLM's eager calls) records one plan per
    # signature and replays it, split-K partials included: those meet in the long-lived workspace, which a
    # plan holds as a constant. Replays equal the body's own launches bit for bit and leave the workspace
    # zeroed for the next call.
    from squeezeserve.kernels.ops import quant_matmul as qm

    monkeypatch.setattr(qm, "PREFILL", "triton")  # 70 rows: the prefill GEMM at any width
    plans = replay.LaunchPlans(persistent=qm.workspace_buffers)
    body = Counting(qm._quant_matmul)
    qweight, scales = _packed_weight(40, 256, 32, device)
    with torch.no_grad():
        with registry.direct_launches:  # the workspace made first: making it is a fill, which no plan repeats
            qm._quant_matmul(torch.randn(m, 256, device=device).half(), qweight, scales, None, 32, 4)
        for _ in range(3):
            x = torch.randn(m, 256, device=device).half()
            got = plans(body, (x, qweight, scales, None, 32, 4))
            with registry.direct_launches:
                expected = qm._quant_matmul(x, qweight, scales, None, 32, 4)
            assert torch.equal(got, expected)
    assert body.runs == 1, "the body ran again where the plan should have replayed"
    assert isinstance(next(iter(plans.plans.values())), replay._Plan)
    assert all(not t.any() for t in qm.workspace_buffers()), "a replay left partial sums in the workspace"


def test_calls_through_the_opaque_op_record_plans(device, monkeypatch):
    # vLLM warms its prompt sizes through quant_matmul_opaque at load (the same signature in every layer),
    # then runs prompts through quant_matmul_eager: both share one memo. Inside the custom op, the body's
    # y.to(x.dtype) reaches the recorder as aten.to returning its input; counted as an op a replay would
    # skip, it failed every recording there and left those prompt sizes on the whole body (the H100).
    from squeezeserve.kernels.ops import quant_matmul as qm

    monkeypatch.setattr(qm, "PREFILL", "triton")  # 70 rows, split along K: the workspace path
    qweight, scales = _packed_weight(40, 256, 32, device)
    x = torch.randn(70, 256, device=device).half()
    args = (x, qweight, scales, None, 32, 4)
    with torch.no_grad(), registry.direct_launches:
        expected = qm._quant_matmul(*args)  # (the workspace made first, as above)
    key = replay.signature((*args, False))  # (the op hands the body its pdl: off a graph's capture, False)
    if x.is_cuda:
        key = (key, torch.cuda.current_device())
    memo = qm.quant_matmul_eager.plans
    memo.plans.pop(key, None)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(torch.ops.squeezeserve.quant_matmul_opaque(*args), expected)
    assert type(memo.plans.get(key)) is replay._Plan


def _body_and_no_plans(body, args: tuple, op):
    """``body(*args)`` (its workspace made first: a fill, which no plan repeats), the key of their plan, and
    ``op``'s plans, emptied (the C++ replayer's too: it would replay an earlier test's)."""
    with torch.no_grad(), registry.direct_launches:
        expected = body(*args)
    key = replay.signature(args)
    if args[0].is_cuda:
        key = (key, torch.cuda.current_device())
    op.plans.clear()
    return expected, key, op.plans


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_eager_calls_of_the_registered_op_record_plans(grad, device, monkeypatch):
    # torch.ops.squeezeserve.quant_matmul called eagerly (torch's triton_op runs the body with wrap_triton
    # off) shares quant_matmul_eager's plans: the body once, then its launches replayed, the product and,
    # through the op's autograd formula, dx as the body's own.
    from squeezeserve.kernels import quant_layout as ql
    from squeezeserve.kernels.ops import quant_matmul as qm

    monkeypatch.setattr(qm, "PREFILL", "triton")  # 70 rows, split along K: the workspace path
    qweight, scales = _packed_weight(40, 256, 32, device)
    x = torch.randn(70, 256, device=device).half()
    args = (x, qweight, scales, None, 32, 4)
    expected, key, memo = _body_and_no_plans(qm._quant_matmul, args, qm.quant_matmul_eager)
    body = Counting(qm._quant_matmul)
    monkeypatch.setattr(qm, "_quant_matmul", body)
    for _ in range(3):
        xi = x.detach().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            y = torch.ops.squeezeserve.quant_matmul(xi, qweight, scales, None, 32, 4)
        assert torch.equal(y.detach(), expected)
        if grad:
            (dx,) = torch.autograd.grad(y, xi, torch.ones_like(y))
            weight = ql.dequantize(qweight, scales, None, (40, 256), 32, 4).to(x.dtype)
            assert torch.equal(dx, torch.ones_like(y) @ weight)
    assert body.runs == 1, "the body ran again where the plan should have replayed"
    assert type(memo.plans.get(key)) is replay._Plan


@pytest.mark.parametrize(("m", "bits"), [(1, 4), (1, 3), (5, 4)], ids=["fma", "lut", "mma"])
def test_codebook_matmul_calls_share_one_plan(m, bits, device, monkeypatch):
    # codebook_matmul's eager calls, each way a caller makes them (the functional API, the registered op
    # through torch's dispatcher, vLLM's opaque op), record one plan per signature between them and replay
    # it: the body once, the product its own, split-K partials met in the workspace and cleaned up.
    from squeezeserve.kernels import codebook_layout as cl
    from squeezeserve.kernels.ops import codebook_matmul as cm
    from squeezeserve.kernels.ops import quant_matmul as qm

    indices = cl.pack_indices(torch.randint(0, 1 << bits, (24, 200)), bits).to(device)
    codebook = torch.randn(24, 1 << bits).half().to(device)
    x = torch.randn(m, 200, device=device).half()
    args = (x, indices, codebook, 0, bits)
    expected, key, memo = _body_and_no_plans(cm._codebook_matmul, args, cm.codebook_matmul_eager)
    body = Counting(cm._codebook_matmul)
    monkeypatch.setattr(cm, "_codebook_matmul", body)
    # (the functional API's EagerOp counted too: the same op with the counting body, sharing its plans)
    counted = dataclasses.replace(cm.codebook_matmul_eager, forward=body)
    monkeypatch.setattr(cm, "codebook_matmul_eager", counted)
    ops = torch.ops.squeezeserve
    with torch.no_grad():
        for call in (K.codebook_matmul, ops.codebook_matmul, ops.codebook_matmul_opaque) * 2:
            assert torch.equal(call(*args), expected), call
    assert body.runs == 1, "the body ran again where the plan should have replayed"
    assert type(memo.plans.get(key)) is replay._Plan
    assert all(not t.any() for t in qm.workspace_buffers()), "a replay left partial sums in the workspace"


def test_the_recorder_notes_writes_but_not_ops_that_return_their_input():
    # (below autograd, as in a custom op's body, y.to(y.dtype) and y.contiguous() reach a dispatch mode)
    noted = []

    @torch.library.custom_op("squeezeserve_test::recorded_body", mutates_args=())
    def body(x: torch.Tensor) -> torch.Tensor:
        views = replay._OnlyViews()
        with views:
            y = torch.empty_like(x).view(-1)
            y = y.to(y.dtype).contiguous()
            noted.append(list(views.other))
            y.fill_(1.0)  # writes (and returns its input)
            noted.append(list(views.other))
            z = y.to(torch.float64)  # a copy
            noted.append(list(views.other))
        return z

    body(torch.randn(2, 3))
    assert noted[0] == []
    assert noted[1] == ["aten.fill_.Scalar"]
    assert noted[2] == ["aten.fill_.Scalar", "aten.to.dtype"]


def test_quant_serving_plans_skip_the_dequantize_path(device, monkeypatch):
    # Dequantize + matmul makes a dense weight the body does not return and runs a matmul: no plan, the
    # body on every call, the right product.
    from squeezeserve.kernels.ops import quant_matmul as qm

    monkeypatch.setattr(qm, "PREFILL", "dequantize")
    plans = replay.LaunchPlans(persistent=qm.workspace_buffers)
    body = Counting(qm._quant_matmul)
    qweight, scales = _packed_weight(24, 128, 32, device)
    x = torch.randn(70, 128, device=device).half()
    with torch.no_grad(), registry.direct_launches:
        expected = qm._quant_matmul(x, qweight, scales, None, 32, 4)
    with torch.no_grad():
        for _ in range(replay.RECORD_ATTEMPTS + 1):
            assert torch.equal(plans(body, (x, qweight, scales, None, 32, 4)), expected)
    assert body.runs == replay.RECORD_ATTEMPTS + 1
    assert list(plans.plans.values()) == [replay.RECORD_ATTEMPTS]


def test_a_tma_descriptor_is_made_again_over_the_call_s_tensor():
    # (the Gluon kernel's launch takes descriptors; tests/kernels/test_quant_matmul_gluon.py replays it)
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from squeezeserve.kernels.ops.quant_matmul_gluon import _smem_layout

    recorded_pool = torch.randn(3, 8, 64).bfloat16()
    recorded = TensorDescriptor.from_tensor(recorded_pool[1], [8, 64], _smem_layout(8, 64, torch.bfloat16))
    offset = recorded.base.data_ptr() - recorded_pool.data_ptr()
    pool = torch.randn(3, 8, 64).bfloat16()
    made = replay._argument(pool, replay._DescriptorAt((offset, recorded)))
    assert type(made) is TensorDescriptor and made is not recorded
    assert made.base.data_ptr() == pool[1].data_ptr() and torch.equal(made.base, pool[1])
    assert (made.shape, made.strides, made.block_shape, made.layout, made.padding) == (
        recorded.shape,
        recorded.strides,
        recorded.block_shape,
        recorded.layout,
        recorded.padding,
    )
    assert recorded.base.data_ptr() == recorded_pool[1].data_ptr()  # the recorded one is left as it was
    # Over a whole input (x's descriptor, as the decode's): the call's tensor itself. Before the twenty-fifth
    # session the replay kept the recorded call's tensor here, and every Python replay of the Gluon kernel
    # read the first call's x (the C++ replay encodes its own maps; the Python one ran only for launches the
    # C++ one does not make: programmatic dependents).
    whole = TensorDescriptor.from_tensor(recorded_pool[0], [8, 64], _smem_layout(8, 64, torch.bfloat16))
    call = pool[0]
    made = replay._argument(call, replay._DescriptorAt((0, whole)))
    assert made.base is call and whole.base.data_ptr() == recorded_pool[0].data_ptr()


def test_a_recording_is_not_tracing():
    # The recorder's dispatch mode only observes, so an op body under it takes its eager path (quant_matmul
    # picks the one-launch split-K there); any other mode still counts as tracing.
    x = torch.randn(2)
    with replay._OnlyViews():
        assert registry.eager(x)
    with torch.utils._python_dispatch.TorchDispatchMode():
        assert not registry.eager(x)
