import pytest
import torch

from squeezeserve.kernels import functional as K
from squeezeserve.kernels import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(4, 64), (3, 423, 213)]


def _leaves(shape, dtype, device, n=2, scale=3.0):
    return [(torch.randn(shape, device=device) * scale).to(dtype).requires_grad_() for _ in range(n)]


def _grads_fp32(fn, inputs, grad):
    upcast = [t.detach().float().requires_grad_() for t in inputs]
    out = fn(*upcast)
    out.backward(grad.float())
    return out, [t.grad for t in upcast]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_matches_reference(shape, dtype, device, check):
    gate, up = _leaves(shape, dtype, device)
    out = K.swiglu(gate, up)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref, (d_gate, d_up) = _grads_fp32(reference.swiglu, (gate, up), grad)
    check.close(out, ref, dtype)
    check.close(gate.grad, d_gate, dtype)
    check.close(up.grad, d_up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype, device, check):
    (x,) = _leaves((5, 7, 2 * 213), dtype, device, n=1)
    out = K.silu_and_mul(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref, (dx,) = _grads_fp32(reference.silu_and_mul, (x,), grad)
    assert out.shape == (5, 7, 213)
    check.close(out, ref, dtype)
    check.close(x.grad, dx, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_oai_matches_reference(dtype, device, check):
    # scale 6 with limit 4 puts many values beyond the clamps, exercising both masked gradients.
    x, y = _leaves((3, 423, 213), dtype, device, scale=6.0)
    out = K.swiglu_oai(x, y, alpha=1.702, limit=4.0)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref, (dx, dy) = _grads_fp32(lambda a, b: reference.swiglu_oai(a, b, 1.702, 4.0), (x, y), grad)
    check.close(out, ref, dtype)
    check.close(x.grad, dx, dtype)
    check.close(y.grad, dy, dtype)


@pytest.fixture
def big_tiles(monkeypatch):
    """The large-shape tiling (one row a program, 16 warps) at test sizes, narrower than a row so that the
    column masks and the packed form's strides are crossed; no launch plan of the other tiling replays."""
    from squeezeserve.kernels.ops import swiglu as sw

    monkeypatch.setattr(sw, "BIG_GRID", 1)
    monkeypatch.setattr(sw, "BIG_BLOCK", 128)
    monkeypatch.setattr(sw, "BIG_BLOCK_BWD", 256)
    eager_ops = (sw.swiglu_eager, sw.silu_and_mul_eager, sw.swiglu_oai_eager)
    for op in eager_ops:
        op.plans.clear()
    assert sw._tiles(6, 213) == (1, 128, (6, 2), 16) and sw._tiles(6, 213, backward=True)[:2] == (1, 256)
    yield
    for op in eager_ops:
        op.plans.clear()


@pytest.mark.parametrize("form", ["swiglu", "silu_and_mul", "swiglu_oai"])
def test_large_shape_tiling_matches_reference(form, big_tiles, device, check):
    dtype = torch.bfloat16
    if form == "silu_and_mul":
        inputs = _leaves((6, 2 * 213), dtype, device, n=1)
        fn, ref_fn = K.silu_and_mul, reference.silu_and_mul
    elif form == "swiglu":
        inputs = _leaves((6, 213), dtype, device)
        fn, ref_fn = K.swiglu, reference.swiglu
    else:
        inputs = _leaves((6, 213), dtype, device, scale=6.0)
        fn = lambda a, b: K.swiglu_oai(a, b, 1.702, 4.0)  # noqa: E731
        ref_fn = lambda a, b: reference.swiglu_oai(a, b, 1.702, 4.0)  # noqa: E731
    out = fn(*inputs)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref, ref_grads = _grads_fp32(ref_fn, inputs, grad)
    check.close(out, ref, dtype)
    for t, expected in zip(inputs, ref_grads, strict=True):
        check.close(t.grad, expected, dtype)


def test_swiglu_rejects_mismatched_inputs(device):
    with pytest.raises(ValueError, match="gate and up must match"):
        K.swiglu(torch.randn(2, 3, device=device), torch.randn(2, 4, device=device))
    with pytest.raises(ValueError, match="must be even"):
        K.silu_and_mul(torch.randn(2, 5, device=device))


def test_swiglu_opcheck(device, check):
    a, b = (torch.randn(3, 17, device=device, requires_grad=True) for _ in range(2))
    check.opcheck(torch.ops.squeezeserve.swiglu.default, (a, b))
    check.opcheck(torch.ops.squeezeserve.swiglu_oai.default, (a, b, 1.702, 1.0))
    check.opcheck(
        torch.ops.squeezeserve.silu_and_mul.default, (torch.randn(3, 34, device=device, requires_grad=True),)
    )
    g = torch.randn(3, 17, device=device)
    check.opcheck(torch.ops.squeezeserve.swiglu_backward.default, (g, a.detach(), b.detach()))
    check.opcheck(torch.ops.squeezeserve.swiglu_oai_backward.default, (g, a.detach(), b.detach(), 1.702, 1.0))
    x = torch.randn(3, 34, device=device)
    check.opcheck(torch.ops.squeezeserve.silu_and_mul_backward.default, (g, x))
