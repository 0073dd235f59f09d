"""The functional API's eager fast path (registry.EagerOp) against the registered ops it stands in for."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from squeezeserve.kernels import functional as K
from squeezeserve.kernels import registry

_ops = torch.ops.squeezeserve
EPS = 1e-6

# (functional call, registered op call, input shapes): the same bodies run both ways.
CASES = {
    "swiglu": (K.swiglu, _ops.swiglu, [(3, 37), (3, 37)]),
    "swiglu_oai": (
        lambda x, y: K.swiglu_oai(x, y, 1.702, 2.0),
        lambda x, y: _ops.swiglu_oai(x, y, 1.702, 2.0),
        [(3, 37), (3, 37)],
    ),
    "silu_and_mul": (K.silu_and_mul, _ops.silu_and_mul, [(3, 74)]),
    "rmsnorm": (lambda x, w: K.rmsnorm(x, w, EPS), lambda x, w: _ops.rmsnorm(x, w, EPS), [(3, 37), (37,)]),
    "add_rmsnorm": (
        lambda x, r, w: K.add_rmsnorm(x, r, w, EPS),
        lambda x, r, w: _ops.add_rmsnorm(x, r, w, EPS),
        [(3, 37), (3, 37), (37,)],
    ),
    "softmax": (K.softmax, _ops.softmax, [(3, 37)]),
}


def _run(fn, inputs, grads_out):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, grads_out)
    return outs, [t.grad for t in leaves]


@pytest.mark.parametrize("name", CASES)
def test_eager_path_equals_registered_op(name, device):
    fast, registered, shapes = CASES[name]
    inputs = [torch.randn(s, device=device) for s in shapes]
    with torch.no_grad():
        reference_out = registered(*inputs)
    reference_out = reference_out if isinstance(reference_out, tuple) else (reference_out,)
    grads_out = [torch.randn_like(t) for t in reference_out]
    fast_outs, fast_grads = _run(fast, inputs, grads_out)
    op_outs, op_grads = _run(registered, inputs, grads_out)
    # The same kernels on the same inputs: bit-identical outputs and gradients.
    for a, b in zip((*fast_outs, *fast_grads), (*op_outs, *op_grads), strict=True):
        assert torch.equal(a, b)


def test_traced_calls_keep_the_registered_op():
    x, w = torch.randn(2, 8), torch.rand(8) + 0.5
    with registry.triton_on_cpu(False):  # the reference bodies: this tests dispatch, not kernels
        graph = make_fx(lambda a, b: K.swiglu(K.rmsnorm(a, b, EPS), a))(x, w)
    targets = {node.target for node in graph.graph.nodes if node.op == "call_function"}
    assert _ops.rmsnorm.default in targets and _ops.swiglu.default in targets


def test_eager_is_false_while_tracing_or_for_subclasses():
    x = torch.randn(2)
    assert registry.eager(x, None)
    seen = []
    make_fx(lambda a: seen.append(registry.eager(a)) or a)(x)
    assert seen == [False]
    assert registry.eager(torch.nn.Parameter(x))  # module weights take the fast path

    class Subclass(torch.Tensor):
        pass

    assert not registry.eager(x.as_subclass(Subclass))
