"""Quantizers, GPTQ, pruning masks and option validation on small random tensors (no model)."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from squeezeserve.kernels.quant_layout import pack_int32
from squeezeserve.service.compress.gptq import gptq_quantize
from squeezeserve.service.compress.options import build_options
from squeezeserve.service.compress.prune import parse_sparsity, prune_mask
from squeezeserve.service.compress.quantize import QuantScheme, quantize_rtn

INT4_G32 = QuantScheme("int", 4, 32, symmetric=False)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("packed_dim", [0, 1])
def test_our_packing_is_compressed_tensors_packing(bits: int, packed_dim: int) -> None:
    codes = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (24, 40), dtype=torch.int8)
    assert torch.equal(pack_int32(codes, bits, packed_dim), pack_to_int32(codes, bits, packed_dim=packed_dim))


def test_rtn_error_is_at_most_half_a_step() -> None:
    weight = torch.randn(16, 96)
    q = quantize_rtn(weight, INT4_G32)
    step = q.scale.float().repeat_interleave(32, dim=1)
    # Half a quantization step, plus float16 rounding of the scale (relative 2^-11 of up to 15 steps).
    assert ((weight - q.dequantize()).abs() <= step * (0.5 + 15 * 2**-11)).all()
    assert q.codes.dtype == torch.int8 and int(q.codes.min()) >= -8 and int(q.codes.max()) <= 7


def test_gptq_has_lower_output_error_than_rtn() -> None:
    torch.manual_seed(0)
    mixing = torch.randn(64, 64)  # correlated input features: where GPTQ's compensation pays
    x = torch.randn(2048, 64) @ mixing
    weight = torch.randn(32, 64)
    gram = x.T @ x
    rtn = quantize_rtn(weight, INT4_G32).dequantize()
    gptq = gptq_quantize(weight, gram, INT4_G32).dequantize()
    rtn_error = torch.linalg.norm(x @ (weight - rtn).T)
    gptq_error = torch.linalg.norm(x @ (weight - gptq).T)
    assert gptq_error < 0.9 * rtn_error


def test_two_four_mask_survives_gptq() -> None:
    torch.manual_seed(1)
    x = torch.randn(512, 64)
    weight = torch.randn(16, 64)
    mask = prune_mask(weight.abs(), parse_sparsity("2:4"))
    q = gptq_quantize(weight * mask, x.T @ x, INT4_G32, mask=mask).dequantize()
    assert torch.equal((q != 0).view(16, 16, 4).sum(-1), torch.full((16, 16), 2))
    assert torch.equal(q != 0, mask)


def test_unstructured_mask_prunes_each_row_by_the_fraction() -> None:
    mask = prune_mask(torch.rand(8, 100), parse_sparsity("0.5"))
    assert torch.equal(mask.sum(dim=1), torch.full((8,), 50))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "int3"}, "unknown method"),
        ({"method": "fp8", "sparsity": "2:4"}, "fp8 does not combine"),
        ({"method": "prune"}, "needs --sparsity"),
        ({"method": "int4"}, "needs calibration text"),
        ({"method": "int8", "group_size": 64}, "int4 only"),
        ({"method": "int4", "algorithm": "rtn", "sparsity": "3:2"}, "0 < N < M"),
        ({"method": "int8", "recover_steps": 5}, "give --sparsity"),
    ],
)
def test_impossible_options_are_refused_with_a_reason(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_options(**kwargs)


def test_kept_weight_keeps_a_nonzero_code_when_the_zero_point_is_qmax() -> None:
    # A group with no positive weight: its range widens to include 0, so its zero point is qmax (7) and a
    # kept weight of (almost) 0 cannot step up; it must step down instead of collapsing onto the zero code.
    weight = -torch.rand(4, 32) - 0.1
    weight[:, 0] = 1e-30
    mask = torch.ones_like(weight, dtype=torch.bool)
    mask[:, 1::2] = False
    q = gptq_quantize(weight * mask, torch.eye(32), INT4_G32, mask=mask)
    assert torch.equal(q.zero_point, torch.full((4, 1), 7, dtype=torch.int8))
    assert torch.equal(q.dequantize() != 0, mask)
