import pytest
import torch

from squeezeserve.kernels import functional as K
from squeezeserve.kernels import reference
from squeezeserve.kernels.ops import softmax as softmax_op

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# the last shape is wider than one block: it takes the online two-pass path.
SHAPES = [(4, 64), (3, 423, 213), (2, softmax_op.SINGLE_BLOCK_COLS + 3616)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_softmax_matches_reference(shape, dtype, device, check):
    _check_softmax(shape, dtype, device, check)


@pytest.mark.parametrize(
    ("spins", "max_chunks"),
    # split: chunks wait for their row (on a GPU) or leave their output to its last arrival (spins 0, and
    # always under the interpreter); a row of more chunks than the state word holds goes online.
    [(None, None), (0, None), (None, 2)],
)
def test_softmax_wide_row_paths(spins, max_chunks, device, check, monkeypatch):
    # Rows wider than one block, and a row whose first chunk is all -inf (a zero partial sum).
    if spins is not None:
        monkeypatch.setattr(softmax_op, "WAIT_POLLS", spins)
    if max_chunks is not None:
        monkeypatch.setattr(softmax_op, "MAX_SPLIT_CHUNKS", max_chunks)
        assert not softmax_op._split(softmax_op.SINGLE_BLOCK_COLS + 3616)
    _check_softmax((2, softmax_op.SINGLE_BLOCK_COLS + 3616), torch.float32, device, check)
    x = torch.randn(2, softmax_op.SINGLE_BLOCK_COLS + 3616, device=device)
    x[0, : softmax_op.SPLIT_CHUNK + 5] = float("-inf")
    out = K.softmax(x)
    assert torch.all(out[0, : softmax_op.SPLIT_CHUNK + 5] == 0)
    check.close(out, reference.softmax(x), torch.float32)


def _check_softmax(shape, dtype, device, check):
    x = (torch.randn(shape, device=device) * 4).to(dtype).requires_grad_()
    out = K.softmax(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    xf = x.detach().float().requires_grad_()
    ref = torch.softmax(xf, dim=-1)
    ref.backward(grad.float())
    check.close(out, ref, dtype)
    check.close(x.grad, xf.grad, dtype)
    torch.testing.assert_close(out.float().sum(-1), torch.ones(shape[:-1], device=device), atol=1e-2, rtol=0)


def test_softmax_handles_minus_infinity(device, check):
    x = torch.randn(3, 50, device=device)
    x[:, 10:] = float("-inf")  # a causal mask: masked columns get exactly zero
    out = K.softmax(x)
    assert torch.all(out[:, 10:] == 0)
    check.close(out, reference.softmax(x), torch.float32)


def test_softmax_opcheck(device, check):
    x = torch.randn(3, 40, device=device, requires_grad=True)
    check.opcheck(torch.ops.squeezeserve.softmax.default, (x,))
    check.opcheck(
        torch.ops.squeezeserve.softmax_backward.default,
        (torch.randn(3, 40, device=device), x.detach().softmax(-1)),
    )
