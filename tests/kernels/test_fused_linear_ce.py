import pytest
import torch
import torch.nn.functional as F

from squeezeserve.kernels import functional as K
from squeezeserve.kernels.ops.fused_linear_ce import chunk_tokens


def _eager(hidden, weight, target, bias, **kw):
    return F.cross_entropy(F.linear(hidden, weight, bias).float(), target, **kw)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("smoothing", "reduction"), [(0.0, "mean"), (0.1, "sum")])
@pytest.mark.parametrize("grad_scale", [1.0, 2.0])  # 1: the eager backward returns the gradients unscaled
@pytest.mark.parametrize("v", [301, 20])  # v / h > 1: several chunks of tokens; v < h: one chunk
def test_flce_matches_eager_fp32(with_bias, smoothing, reduction, grad_scale, v, device):
    n, h = 37, 24
    assert (chunk_tokens(n, h, v) < n) == (v > h)
    hidden = torch.randn(n, h, device=device, requires_grad=True)
    weight = (torch.randn(v, h, device=device) / h**0.5).requires_grad_()
    bias = torch.randn(v, device=device, requires_grad=True) if with_bias else None
    target = torch.randint(0, v, (n,), device=device)
    target[::5] = -100
    kw = {"ignore_index": -100, "label_smoothing": smoothing, "reduction": reduction}
    loss = K.fused_linear_cross_entropy(hidden, weight, target, bias, **kw)
    (loss * grad_scale).backward()
    inputs = [hidden, weight] + ([bias] if with_bias else [])
    ours = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    ref = _eager(hidden, weight, target, bias, **kw)
    (ref * grad_scale).backward()
    # fp32 throughout: matmul and reduction order only (chunked GEMMs, online softmax).
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for got, t in zip(ours, inputs, strict=True):
        torch.testing.assert_close(got, t.grad, atol=1e-5, rtol=1e-4)


def test_flce_bf16_within_bf16_rounding(device):
    n, h, v = 40, 32, 257
    hidden = torch.randn(n, h, device=device).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device=device) / h**0.5).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, v, (n,), device=device)
    loss = K.fused_linear_cross_entropy(hidden, weight, target)
    loss.backward()
    hf, wf = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref = _eager(hf, wf, target, None)
    ref.backward()
    # bf16 logits (8 mantissa bits) move the loss by ~1e-3 relative; the gradients are bf16 GEMM outputs
    # accumulated over chunks in bf16: compare by relative norm, where bf16 rounding lands near 4e-3.
    torch.testing.assert_close(loss, ref, atol=2e-2, rtol=1e-2)
    for got, want in ((hidden.grad, hf.grad), (weight.grad, wf.grad)):
        rel = ((got.float() - want).norm() / want.norm()).item()
        assert rel < 2e-2, rel


def test_flce_no_grad_and_bad_reduction(device):
    hidden, weight = torch.randn(6, 8, device=device), torch.randn(20, 8, device=device)
    target = torch.randint(0, 20, (6,), device=device)
    with torch.no_grad():
        loss = K.fused_linear_cross_entropy(hidden, weight, target)
    torch.testing.assert_close(loss, _eager(hidden, weight, target, None), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        K.fused_linear_cross_entropy(hidden, weight, target, reduction="none")


def test_flce_opcheck(device, check):
    hidden = torch.randn(6, 8, device=device, requires_grad=True)
    weight = torch.randn(20, 8, device=device, requires_grad=True)
    target = torch.randint(0, 20, (6,), device=device)
    check.opcheck(
        torch.ops.squeezeserve.fused_linear_cross_entropy.default,
        (hidden, weight, target, None, -100, 0.0, "mean", True),
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak memory is read from the CUDA allocator")
def test_flce_holds_one_chunk_of_logits_at_a_time():
    # Beyond the inputs, the step's peak is the two gradients plus one chunk of logits (a buffer every
    # chunk reuses). Allocating each chunk's logits anew kept the last chunk alive while the next one was
    # computed: two chunks at the peak (+128 MB at N=16k, V=128k, H=4096).
    n, h, v = 4096, 256, 32000
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / 16).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda")
    chunk_bytes = chunk_tokens(n, h, v) * v * 2
    K.fused_linear_cross_entropy(hidden, weight, target).backward()  # cuBLAS workspaces, kernels compiled
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    K.fused_linear_cross_entropy(hidden, weight, target).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    gradients = (n + v) * h * 2
    assert peak <= gradients + chunk_bytes * 1.25, (peak, gradients, chunk_bytes)


@pytest.mark.parametrize("op_name", ["fused_linear_cross_entropy_eager", "fused_linear_kd_eager"])
def test_fused_losses_get_no_zero_filled_grads_for_their_gradient_outputs(op_name, device):
    # The fused losses return their gradients as extra outputs that nothing backpropagates through; by
    # default autograd would hand the backward a zero tensor for each (as large as the gradients: twice
    # their memory at the backward's peak). The eager ops ask for None instead.
    from squeezeserve.kernels.ops import fused_linear_ce, fused_linear_kd
    from squeezeserve.kernels.registry import EagerOp

    op = getattr(fused_linear_ce, op_name, None) or getattr(fused_linear_kd, op_name)
    seen = []

    def spy(ctx, grad_loss, *rest):
        seen.extend(rest)
        return op.backward(ctx, grad_loss, *rest)

    n, h, v = 24, 16, 100
    hidden = torch.randn(n, h, device=device, requires_grad=True)
    weight = torch.randn(v, h, device=device, requires_grad=True)
    target = torch.randint(0, v, (n,), device=device)
    if op_name.startswith("fused_linear_cross_entropy"):
        args = (hidden, weight, target, None, -100, 0.0, "mean", True)
    else:
        teacher = (torch.randn(n, h, device=device), torch.randn(v, h, device=device))
        args = (hidden, weight, *teacher, None, 1.0, 0.0, -100, "mean", True, True)
    spied = EagerOp(op.forward, op.setup_context, spy, op.materialize_grads)
    spied(*args)[0].backward()
    assert seen and all(g is None for g in seen), [type(g) for g in seen]
    assert hidden.grad is not None and weight.grad is not None


def test_flce_eager_backward_reads_a_unit_gradient_and_skips_the_scaling(monkeypatch, device):
    # loss.backward() hands the loss a gradient of exactly 1: the eager backward returns the gradients the
    # forward made without a pass over them (grad_weight is 1.05 GB at V=128k, H=4096); any other gradient
    # scales them. The values are checked against eager PyTorch in test_flce_matches_eager_fp32.
    from squeezeserve.kernels.ops import fused_linear_ce

    seen = []
    read = fused_linear_ce.unit_grad
    monkeypatch.setattr(fused_linear_ce, "unit_grad", lambda g: seen.append(read(g)) or seen[-1])
    hidden = torch.randn(9, 8, device=device, requires_grad=True)
    weight = torch.randn(30, 8, device=device, requires_grad=True)
    target = torch.randint(0, 30, (9,), device=device)
    K.fused_linear_cross_entropy(hidden, weight, target).backward()
    (K.fused_linear_cross_entropy(hidden, weight, target) * 3).backward()
    assert seen == [True, False]
    assert read(torch.tensor(1.0)) and not read(torch.tensor(1.0 + 2**-20)) and not read(torch.ones(2))
