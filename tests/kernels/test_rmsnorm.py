import pytest
import torch

from squeezeserve.kernels import functional as K
from squeezeserve.kernels import reference
from squeezeserve.kernels.registry import triton_on_cpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(4, 64), (3, 423, 213), (2, 5000)]
EPS = 1e-6


def _inputs(shape, dtype, device):
    x = (torch.randn(shape, device=device) * 2 + 0.5).to(dtype).requires_grad_()
    w = (torch.rand(shape[-1], device=device) + 0.5).to(dtype).requires_grad_()
    return x, w


def _reference_grads(x, w, grad):
    xf, wf = (t.detach().float().requires_grad_() for t in (x, w))
    out = reference.rmsnorm(xf, wf, EPS)
    out.backward(grad.float())
    return out, xf.grad, wf.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm_matches_reference(shape, dtype, device, check):
    x, w = _inputs(shape, dtype, device)
    out = K.rmsnorm(x, w, EPS)
    grad = torch.randn_like(out)
    out.backward(grad)
    # Forward against the reference in the input dtype: it rounds the normalised row like HF does.
    check.close(out, reference.rmsnorm(x.detach(), w.detach(), EPS), dtype)
    _, dx, dw = _reference_grads(x, w, grad)
    check.close(x.grad, dx, dtype)
    # dw sums over every row; scale the tolerance by the sum's magnitude instead of per-element ulps.
    torch.testing.assert_close(
        w.grad.float(), dw, atol=2e-2 * dw.abs().max().item() if dtype != torch.float32 else 1e-3, rtol=2e-2
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_matches_reference(dtype, device, check):
    x, w = _inputs((3, 423, 213), dtype, device)
    residual = torch.randn_like(x).requires_grad_()
    out, h = K.add_rmsnorm(x, residual, w, EPS)
    _, ref_h = reference.add_rmsnorm(x.detach(), residual.detach(), w.detach(), EPS)
    # One rounding of the sum on both sides (bit-equal on a GPU; Triton's interpreter truncates when it
    # rounds fp32 to bf16, so allow the ulp).
    check.close(h, ref_h, dtype)
    check.close(out, reference.rmsnorm(h.detach(), w.detach(), EPS), dtype)
    grad_out, grad_h = torch.randn_like(out), torch.randn_like(h)
    torch.autograd.backward((out, h), (grad_out, grad_h))
    # Differentiate at our h, so a one-ulp difference in the add cannot move the comparison.
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    torch.autograd.backward((reference.rmsnorm(hf, wf, EPS), hf), (grad_out.float(), grad_h.float()))
    check.close(x.grad, hf.grad, dtype)
    check.close(residual.grad, hf.grad, dtype)


def test_rmsnorm_wide_rows(device, check):
    x, w = _inputs((2, 65536), torch.float32, device)
    check.close(K.rmsnorm(x, w, EPS), reference.rmsnorm(x.detach(), w.detach(), EPS), torch.float32)
    with pytest.raises(ValueError, match="65537 elements exceed"):
        K.rmsnorm(torch.randn(1, 65537, device=device), torch.ones(65537, device=device), EPS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_reference_is_hugging_face_rmsnorm_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    torch.nn.init.uniform_(hf.weight, 0.5, 1.5)
    x = torch.randn(4, 7, 96).to(dtype)
    with triton_on_cpu(False):
        assert torch.equal(K.rmsnorm(x, hf.weight, 1e-5), hf(x))


def test_rmsnorm_opcheck(device, check):
    x, w = _inputs((3, 40), torch.float32, device)
    check.opcheck(torch.ops.squeezeserve.rmsnorm.default, (x, w, EPS))
    check.opcheck(torch.ops.squeezeserve.add_rmsnorm.default, (x, torch.randn_like(x), w, EPS))
    check.opcheck(
        torch.ops.squeezeserve.rmsnorm_backward.default,
        (torch.randn(3, 40, device=device), x.detach(), w.detach(), EPS),
    )
    g = torch.randn(3, 40, device=device)
    check.opcheck(
        torch.ops.squeezeserve.add_rmsnorm_backward.default,
        (g, torch.randn_like(g), x.detach(), w.detach(), EPS),
    )
