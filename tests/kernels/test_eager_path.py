"""The functional API's eager fast path (registry.EagerOp) against the registered ops it stands in for."""

import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from squeezeserve.kernels import codebook_layout, quant_layout, registry
from squeezeserve.kernels import functional as K
from squeezeserve.kernels.ops import codebook_matmul, quant_matmul

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


def _body_runs_and_equals_the_op(monkeypatch, module, eager_name, fast, registered, x, grad_out):
    """``fast`` (a functional call) runs ``module.eager_name``'s body, not the dispatcher, and gives the
    output and dx that ``registered`` (the op) gives, bit for bit."""
    bodies = []
    op = getattr(module, eager_name)
    counted = dataclasses.replace(op, forward=lambda *a: bodies.append(1) or op.forward(*a))
    monkeypatch.setattr(module, eager_name, counted)
    fast_outs, fast_grads = _run(fast, [x], [grad_out])
    assert bodies, f"{eager_name}'s functional call went through the dispatcher"
    op_outs, op_grads = _run(registered, [x], [grad_out])
    for a, b in zip((*fast_outs, *fast_grads), (*op_outs, *op_grads), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("zeros", [False, True])
def test_quant_matmul_eager_path_equals_registered_op(zeros, device, monkeypatch):
    # K.quant_matmul (QuantLinear's forward) runs the op's body without the dispatcher, whose custom-op
    # layers cost the H200's host more than the kernel at decode sizes (NOTES.md, forty-third session).
    t = quant_layout.pack_weight(torch.randn(24, 64), 4, 32, symmetric=not zeros)
    weight = [t["weight_packed"].to(device), t["weight_scale"].half().to(device)]
    weight.append(t["weight_zero_point"].to(device) if zeros else None)
    x, grad_out = torch.randn(5, 64, device=device).half(), torch.randn(5, 24, device=device).half()
    _body_runs_and_equals_the_op(monkeypatch, quant_matmul, "quant_matmul_eager",
                                 lambda a: K.quant_matmul(a, *weight, 32, 4),
                                 lambda a: _ops.quant_matmul(a, *weight, 32, 4), x, grad_out)  # fmt: skip


def test_codebook_matmul_eager_path_equals_registered_op(device, monkeypatch):
    # (as quant_matmul's: K.codebook_matmul runs the op's body without the dispatcher)
    indices = codebook_layout.pack_indices(torch.randint(0, 16, (24, 64), dtype=torch.int32), 4).to(device)
    book = torch.randn(24, 2 * 16, device=device).half()  # (groups of 32: two codebooks a row)
    x, grad_out = torch.randn(5, 64, device=device).half(), torch.randn(5, 24, device=device).half()
    fast = lambda a: K.codebook_matmul(a, indices, book, 32, 4)  # noqa: E731
    registered = lambda a: _ops.codebook_matmul(a, indices, book, 32, 4)  # noqa: E731
    _body_runs_and_equals_the_op(monkeypatch, codebook_matmul, "codebook_matmul_eager", fast, registered, x,
                                 grad_out)  # fmt: skip


def test_traced_calls_keep_the_registered_op():
    x, w = torch.randn(2, 8), torch.rand(8) + 0.5
    t = quant_layout.pack_weight(torch.randn(8, 8), 4, 8, symmetric=True)
    weight = (t["weight_packed"], t["weight_scale"], None, 8, 4)
    with registry.triton_on_cpu(False):  # the reference bodies: this tests dispatch, not kernels
        graph = make_fx(lambda a, b: K.quant_matmul(K.swiglu(K.rmsnorm(a, b, EPS), a), *weight))(x, w)
    targets = {node.target for node in graph.graph.nodes if node.op == "call_function"}
    assert {_ops.rmsnorm.default, _ops.swiglu.default, _ops.quant_matmul.default} <= targets


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
