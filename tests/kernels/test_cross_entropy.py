import pytest
import torch
import torch.nn.functional as F

from squeezeserve.kernels import functional as K

# Loss and gradients against F.cross_entropy on fp32 logits. The kernel reads the logits, computes in
# fp32 and writes the gradient in the logits' dtype: fp32 loss agrees to reduction-order noise; gradients
# carry one rounding to the logits dtype (TOLERANCES). Mean reduction makes gradients ~1/N small, so the
# absolute tolerance is scaled by N for the low-precision dtypes.
CASES = [
    # (rows, vocab, ignore_index, label_smoothing, reduction)
    (13, 1000, -100, 0.0, "mean"),
    (13, 1000, 3, 0.1, "mean"),
    (9, 3001, -100, 0.2, "sum"),
    (9, 517, 5, 0.0, "none"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab", "ignore", "smoothing", "reduction"), CASES)
def test_cross_entropy_matches_torch(rows, vocab, ignore, smoothing, reduction, dtype, device, check):
    logits = (torch.randn(rows, vocab, device=device) * 3).to(dtype)
    target = torch.randint(0, vocab, (rows,), device=device)
    target[::4] = ignore if ignore >= 0 else -100  # some ignored rows whatever the ignore value
    if ignore >= 0:
        target[target == ignore] = ignore
    ref_in = logits.detach().float().clone().requires_grad_()
    ref = F.cross_entropy(ref_in, target, ignore_index=ignore, label_smoothing=smoothing, reduction=reduction)
    grad_out = torch.rand_like(ref) + 0.5
    ref.backward(grad_out)

    ours_in = logits.detach().clone().requires_grad_()
    loss = K.cross_entropy(
        ours_in, target, ignore_index=ignore, label_smoothing=smoothing, reduction=reduction
    )
    loss.backward(grad_out)
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-4)
    check.close(ours_in.grad, ref_in.grad, dtype)


def test_cross_entropy_overwrites_logits_with_the_gradient(device):
    logits = torch.randn(4, 50, device=device, requires_grad=True)
    target = torch.tensor([1, 2, 3, 4], device=device)
    expected_grad = torch.softmax(logits.detach(), -1) - F.one_hot(target, 50)
    K.cross_entropy(logits, target, reduction="sum")
    torch.testing.assert_close(logits.detach(), expected_grad, atol=1e-5, rtol=1e-4)


def test_cross_entropy_without_grad_keeps_logits(device):
    logits = torch.randn(4, 50, device=device)
    before = logits.clone()
    target = torch.tensor([1, 2, 3, 4], device=device)
    loss = K.cross_entropy(logits, target)
    assert torch.equal(logits, before)
    torch.testing.assert_close(loss, F.cross_entropy(before, target), atol=1e-5, rtol=1e-5)


def test_cross_entropy_rejects_bad_input(device):
    with pytest.raises(ValueError, match="reduction must be one of"):
        K.cross_entropy(
            torch.randn(2, 5, device=device), torch.tensor([0, 1], device=device), reduction="avg"
        )
    with pytest.raises(ValueError, match=r"logits \[N, V\] and target \[N\]"):
        K.cross_entropy(torch.randn(2, 5, device=device), torch.tensor([0, 1, 2], device=device))


def test_cross_entropy_opcheck(device, check):
    logits = torch.randn(5, 40, device=device)
    target = torch.randint(0, 40, (5,), device=device)
    check.opcheck(torch.ops.squeezeserve.cross_entropy_.default, (logits, target, -100, 0.1, "mean", True))
