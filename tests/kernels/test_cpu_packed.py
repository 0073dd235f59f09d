"""The packed CPU linears (torch's int8 / int4 weight-only matmuls) against the dequantized weight.

float32 activations: both sides multiply the same integers and scales and differ only by summation order
(and, for int4, by the offset -z * s added per group instead of subtracting z before scaling): ~1e-6
relative. A wrong nibble order, group or zero point is off by O(|y|).
"""

from __future__ import annotations

import pytest
import torch

from squeezeserve.kernels import cpu_packed, quant_layout

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _quantized(n: int, k: int, bits: int, group: int, symmetric: bool, seed: int = 0):
    """(q int8 [N, K], scale [N, G], zero int8 [N, G] or None, dense [N, K] fp32) of a random weight."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, scale, zero = quant_layout.quantize(weight, bits, group, symmetric)
    dense = q.float() - (0 if zero is None else zero.float().repeat_interleave(group, 1)[:, :k])
    return q, scale, zero, dense * scale.repeat_interleave(group, 1)[:, :k]


@pytest.mark.parametrize(
    ("bits", "group", "symmetric", "n", "k", "form"),
    [
        (8, 96, True, 32, 96, cpu_packed.Int8Linear),  # per channel: one group as wide as K
        (4, 32, False, 32, 96, cpu_packed.Int4Linear),
        (4, 64, True, 48, 128, cpu_packed.Int4Linear),
        (8, 32, True, 32, 96, None),  # group-wise int8: no torch CPU op
        (8, 96, False, 32, 96, None),  # asymmetric int8: _weight_int8pack_mm has no zero point
        (4, 48, True, 32, 96, None),  # a group torch's int4 op does not take
        (4, 32, True, 32, 80, None),  # K not a multiple of the group
        (4, 32, True, 24, 96, None),  # torch's int4 packing takes N in blocks of 16
    ],
)
def test_packed_linear_takes_only_the_formats_torch_has_an_op_for(bits, group, symmetric, n, k, form):
    q, scale, zero, _ = _quantized(n, k, bits, group, symmetric)
    packed = cpu_packed.packed_linear(q, scale, zero, bits, group)
    assert packed is None if form is None else isinstance(packed, form)


@pytest.mark.parametrize(
    ("bits", "group", "symmetric"),
    [(8, 96, True), (4, 32, False), (4, 32, True)],
    ids=["int8", "int4-asym", "int4"],
)
def test_packed_linear_equals_the_dequantized_matmul(bits, group, symmetric):
    q, scale, zero, dense = _quantized(32, 96, bits, group, symmetric)
    bias = torch.randn(32)
    x = torch.randn(2, 3, 96)
    packed = cpu_packed.packed_linear(q, scale, zero, bits, group, bias)
    torch.testing.assert_close(packed(x), x @ dense.T + bias, **TOL)


def test_int4_scale_zero_is_scale_and_minus_zero_times_scale_per_group():
    scale = torch.tensor([[0.5, 2.0], [1.0, 0.25]])
    zero = torch.tensor([[1, -2], [0, 3]], dtype=torch.int8)
    table = cpu_packed.int4_scale_zero(scale, zero)  # [G, N, 2]
    assert table.shape == (2, 2, 2) and table.dtype == torch.float32
    torch.testing.assert_close(table[:, :, 0], scale.T)
    torch.testing.assert_close(table[:, :, 1], (-zero.float() * scale).T)
    assert cpu_packed.int4_scale_zero(scale, None)[:, :, 1].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_matmuls_trace_for_every_row_count(dtype):
    """vLLM compiles one graph for all token counts: both ops trace with a dynamic row count (no graph break,
    no recompile) and the graph computes what the eager call does."""
    q8, scale8, _, _ = _quantized(32, 64, 8, 64, True)
    q4, scale4, zero4, _ = _quantized(32, 64, 4, 32, False)
    packed4 = cpu_packed.pack_int4(q4)
    table = cpu_packed.int4_scale_zero(scale4, zero4).to(dtype)

    def both(x: torch.Tensor) -> torch.Tensor:
        y8 = cpu_packed.int8_matmul(x, q8, scale8.to(dtype)[:, 0])
        return y8 + cpu_packed.int4_matmul(x, packed4, table, 32, 32)

    compiled = torch.compile(both, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (1, 2):  # dynamo specialises a size-1 dim: one graph for 1 row, one for the rest
        compiled(torch.randn(rows, 64, dtype=dtype))
    with torch.compiler.set_stance("fail_on_recompile"):
        for rows in (1, 5, 17):
            x = torch.randn(rows, 64, dtype=dtype)
            torch.testing.assert_close(compiled(x), both(x))
