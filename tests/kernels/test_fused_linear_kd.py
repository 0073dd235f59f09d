import pytest
import torch

from squeezeserve.kernels import functional as K
from squeezeserve.kernels import reference
from squeezeserve.kernels.ops.fused_linear_ce import chunk_tokens


def _inputs(n, h_s, h_t, v, device, dtype=torch.float32, teacher_scale=1.0):
    student_hidden = torch.randn(n, h_s, device=device).to(dtype).requires_grad_()
    student_weight = (torch.randn(v, h_s, device=device) / h_s**0.5).to(dtype).requires_grad_()
    teacher_hidden = torch.randn(n, h_t, device=device).to(dtype)
    teacher_weight = (teacher_scale * torch.randn(v, h_t, device=device) / h_t**0.5).to(dtype)
    return student_hidden, student_weight, teacher_hidden, teacher_weight


@pytest.mark.parametrize(
    ("temperature", "lm_weight", "reduction", "with_target"),
    [(1.0, 0.0, "mean", False), (2.0, 0.0, "sum", True), (0.7, 0.3, "mean", True)],
)
@pytest.mark.parametrize("grad_scale", [1.0, 2.0])  # 1: the eager backward returns the gradients unscaled
def test_fused_kd_matches_the_unfused_loss_fp32(
    temperature, lm_weight, reduction, with_target, grad_scale, device
):
    # v / h > 1 and odd sizes: several chunks of tokens, ragged vocabulary blocks; teacher wider than the
    # student (a distilled student may be narrower).
    n, h_s, h_t, v = 37, 24, 40, 301
    assert chunk_tokens(n, h_s, 2 * v) < n
    sh, sw, th, tw = _inputs(n, h_s, h_t, v, device, teacher_scale=3.0)
    target = None
    if with_target:
        target = torch.randint(0, v, (n,), device=device)
        target[::5] = -100
    kw = {"temperature": temperature, "lm_weight": lm_weight, "reduction": reduction}
    loss = K.fused_linear_kd(sh, sw, th, tw, target, **kw)
    (loss * grad_scale).backward()
    ours = [sh.grad.clone(), sw.grad.clone()]
    sh.grad = sw.grad = None
    ref = reference.linear_kd(sh, sw, th, tw, target, **kw)
    (ref * grad_scale).backward()
    # fp32 throughout: matmul and reduction order only (chunked GEMMs, online softmaxes).
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(ours, (sh.grad, sw.grad), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_fused_kd_is_zero_with_zero_gradient_when_student_is_teacher(device):
    sh, sw, _, _ = _inputs(9, 16, 16, 70, device)
    loss = K.fused_linear_kd(sh, sw, sh.detach(), sw.detach(), temperature=1.5)
    loss.backward()
    torch.testing.assert_close(loss, torch.zeros((), device=device), atol=1e-6, rtol=0)
    torch.testing.assert_close(sh.grad, torch.zeros_like(sh), atol=1e-6, rtol=0)


def test_fused_kd_bf16_within_bf16_rounding(device):
    sh, sw, th, tw = _inputs(40, 32, 32, 257, device, torch.bfloat16)
    loss = K.fused_linear_kd(sh, sw, th, tw, temperature=2.0)
    loss.backward()
    shf, swf = sh.detach().float().requires_grad_(), sw.detach().float().requires_grad_()
    ref = reference.linear_kd(shf, swf, th.float(), tw.float(), temperature=2.0)
    ref.backward()
    # bf16 logits (8 mantissa bits) move the loss by ~1e-2 relative of a loss that is itself a small
    # difference of log-sum-exps; the gradients are bf16 GEMM outputs accumulated in bf16 over chunks:
    # compare by relative norm, where bf16 rounding lands near 4e-3 (a wrong formula is off by O(1)).
    torch.testing.assert_close(loss, ref, atol=2e-2, rtol=2e-2)
    for got, want in ((sh.grad, shf.grad), (sw.grad, swf.grad)):
        rel = ((got.float() - want).norm() / want.norm()).item()
        assert rel < 2e-2, rel


def test_frozen_head_gets_no_gradient_and_no_grad_runs_the_loss_only(device):
    sh, sw, th, tw = _inputs(6, 8, 8, 20, device)
    sw.requires_grad_(False)
    K.fused_linear_kd(sh, sw, th, tw).backward()
    assert sh.grad is not None and sw.grad is None
    with torch.no_grad():
        loss = K.fused_linear_kd(sh, sw, th, tw)
    torch.testing.assert_close(loss, reference.linear_kd(sh, sw, th, tw), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reduction": "none"}, "'mean' or 'sum'"),
        ({"temperature": 0.0}, "temperature must be positive"),
        ({"lm_weight": 0.5}, "needs the targets"),
    ],
)
def test_fused_kd_refuses_bad_arguments(kwargs, message, device):
    sh, sw, th, tw = _inputs(6, 8, 8, 20, device)
    with pytest.raises(ValueError, match=message):
        K.fused_linear_kd(sh, sw, th, tw, **kwargs)
    with pytest.raises(ValueError, match="same vocabulary"):
        K.fused_linear_kd(sh, sw, th, tw[:10])


def test_fused_kd_opcheck(device, check):
    sh, sw, th, tw = _inputs(6, 8, 12, 20, device)
    target = torch.randint(0, 20, (6,), device=device)
    check.opcheck(
        torch.ops.squeezeserve.fused_linear_kd.default,
        (sh, sw, th, tw, target, 2.0, 0.25, -100, "mean", True, True),
    )
