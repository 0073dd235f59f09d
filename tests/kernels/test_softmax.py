import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


@pytest.mark.parametrize(
    "n_cols",
    # 9 chunks, the last of one column; 10 whole chunks; 17 chunks (of 32 the kernel reads), the last ragged
    [softmax_op.SINGLE_BLOCK_COLS + 1, 10 * softmax_op.SPLIT_CHUNK, 2 * softmax_op.SINGLE_BLOCK_COLS + 100],
)
def test_split_rows_leave_the_workspace_zero(n_cols, device, check):
    # Eager split calls meet in the long-lived workspace, which each launch's last program out zeroes again
    # (state words, done counts, partials): call after call gives the right forward and backward.
    assert softmax_op._split(n_cols)
    for _ in range(3):
        _check_softmax((2, n_cols), torch.float32, device, check)
        assert softmax_op._workspace.current, "the eager split path did not take the workspace"
        assert all(not t.any() for t in softmax_op.workspace_buffers()), "a split launch left scratch behind"


def test_split_rows_take_per_call_scratch_when_torch_may_trace(device, check, monkeypatch):
    # A dispatch mode other than a launch plan's recorder may be tracing: the workspace (state outside the
    # op's inputs) stays out of the launch.
    monkeypatch.setattr(softmax_op._workspace, "current", {})
    monkeypatch.setattr(softmax_op._workspace, "retired", [])

    class Tracing(TorchDispatchMode):  # (runs every op as it is, but is not a plan's recorder)
        supports_higher_order_operators = True  # (compiled, a launch is wrap_triton's operator)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, softmax_op.SINGLE_BLOCK_COLS + 3616, device=device)
    with torch.no_grad(), Tracing():
        out = softmax_op._softmax(x)
        grad = softmax_op._softmax_backward(torch.ones_like(x), out)
    assert not softmax_op.workspace_buffers()
    check.close(out, reference.softmax(x), torch.float32)
    check.close(grad, reference.softmax_backward(torch.ones_like(x), out), torch.float32)


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
