"""Quantizers, GPTQ, pruning masks and option validation on small random tensors (no model)."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from squeezeserve.kernels.quant_layout import pack_int32
from squeezeserve.service.compress.gptq import gptq_quantize
from squeezeserve.service.compress.options import build_options
from squeezeserve.service.compress.prune import parse_sparsity, prune_mask
from squeezeserve.service.compress.quantize import (
    QuantizedWeight,
    QuantScheme,
    package,
    quantize_rtn,
    quantize_with,
    search_qparams,
)

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


def q4_1_weight(rows: int, groups: int) -> torch.Tensor:
    """A weight as GGUF Q4_1 stores it: per 32 weights ``d * k + m``, k in 0..15 (both ends used), float m."""
    k = torch.randint(0, 16, (rows, groups, 32))
    k[..., 0], k[..., 1] = 0, 15
    d = torch.rand(rows, groups, 1) * 0.02 + 0.005
    m = -d * (torch.rand(rows, groups, 1) * 13 + 1)  # the group straddles 0 at a random fraction of a step
    return (d * k + m).reshape(rows, groups * 32)


def searched_rtn(
    weight: torch.Tensor, scheme: QuantScheme, importance: torch.Tensor | None
) -> QuantizedWeight:
    grouped = weight.reshape(weight.shape[0], -1, 32)
    scale, zero = search_qparams(grouped, scheme, importance)
    codes = quantize_with(grouped, scale.unsqueeze(-1), zero.unsqueeze(-1), scheme)
    return package(codes.reshape(weight.shape), scale, zero, scheme)


def test_scale_search_fits_a_q4_1_weight_better_than_min_max() -> None:
    torch.manual_seed(2)
    weight = q4_1_weight(64, 6)
    minmax = (quantize_rtn(weight, INT4_G32).dequantize() - weight).square().sum(dim=1)
    searched = (searched_rtn(weight, INT4_G32, None).dequantize() - weight).square().sum(dim=1)
    # Min/max is one of the candidates: no row can get worse (1e-9: float32 sums in another order).
    assert (searched <= minmax * (1 + 1e-6) + 1e-9).all()
    # Measured: 29% less squared error on the bundled model's weights, 48% on these synthetic groups.
    assert searched.sum() < 0.85 * minmax.sum()


def test_scale_search_weighs_errors_by_importance() -> None:
    torch.manual_seed(3)
    weight = q4_1_weight(32, 4)
    importance = torch.ones(4, 32)
    importance[:, :4] = 100.0  # four inputs whose errors cost 100x
    plain = searched_rtn(weight, INT4_G32, None).dequantize() - weight
    weighted = searched_rtn(weight, INT4_G32, importance).dequantize() - weight
    cost = importance.reshape(1, -1)
    assert (weighted.square() * cost).sum() < (plain.square() * cost).sum()


@pytest.mark.parametrize("search", [False, True])
def test_actorder_gptq_with_uncorrelated_inputs_is_rtn_with_static_groups(search: bool) -> None:
    # With a diagonal Hessian no column's error reaches another column: whatever the sweep order, GPTQ must
    # reduce to round-to-nearest under the groups' parameters, which actorder fixes from the weight itself.
    torch.manual_seed(4)
    weight = q4_1_weight(24, 3)
    diagonal = torch.rand(96) + 0.5
    q = gptq_quantize(weight, torch.diag(diagonal), INT4_G32, actorder=True, search=search)
    expected = (
        searched_rtn(weight, INT4_G32, diagonal.view(3, 32)) if search else quantize_rtn(weight, INT4_G32)
    )
    assert torch.equal(q.codes, expected.codes)
    assert torch.equal(q.scale, expected.scale) and torch.equal(q.zero_point, expected.zero_point)


def test_actorder_gptq_has_lower_output_error_than_rtn_and_keeps_2_4() -> None:
    torch.manual_seed(5)
    x = (torch.randn(2048, 64) @ torch.randn(64, 64)) * torch.linspace(0.2, 3.0, 64)  # uneven input scales
    weight = q4_1_weight(32, 2)
    mask = prune_mask(weight.abs(), parse_sparsity("2:4"))
    gram = x.T @ x
    rtn = torch.linalg.norm(x @ (weight - quantize_rtn(weight, INT4_G32).dequantize()).T)
    ordered = gptq_quantize(weight, gram, INT4_G32, actorder=True, search=True).dequantize()
    assert torch.linalg.norm(x @ (weight - ordered).T) < 0.9 * rtn
    sparse = gptq_quantize(weight * mask, gram, INT4_G32, mask=mask, actorder=True, search=True).dequantize()
    assert torch.equal(sparse != 0, mask)


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
        ({"method": "int8", "group_size": 64}, "int4 and codebook only"),
        ({"method": "int4", "algorithm": "rtn", "sparsity": "3:2"}, "0 < N < M"),
        ({"method": "int8", "recover_steps": 5}, "give --sparsity"),
        ({"method": "int4", "algorithm": "rtn", "actorder": True}, "apply to GPTQ"),
        ({"method": "int4", "algorithm": "rtn", "scale_search": True}, "apply to GPTQ"),
        ({"method": "int4", "calibration": "c.txt", "damp": 0.0}, "0 < damp < 1"),
        ({"method": "fp8", "algorithm": "gptq"}, "--algorithm applies to"),
        ({"method": "lowrank", "calibration": "c.txt"}, "needs --rank-ratio"),
        ({"method": "lowrank", "rank_ratio": 1.5, "calibration": "c.txt"}, "0 < F < 1"),
        (
            {"method": "lowrank", "rank_ratio": 0.5, "algorithm": "gptq"},
            "takes --algorithm svdllm or asvd or svd",
        ),
        ({"method": "lowrank", "rank_ratio": 0.5}, "whitened SVD needs calibration"),
        (
            {"method": "lowrank", "rank_ratio": 0.5, "algorithm": "asvd"},
            "activation-aware SVD needs calibration",
        ),
        ({"method": "int4", "rank_ratio": 0.5}, "--rank-ratio applies to --method lowrank"),
        ({"method": "codebook", "bits": 2, "calibration": "c.txt"}, "--bits must be one of 3, 4"),
        ({"method": "codebook", "calibration": "c.txt", "scale_search": True}, "codebooks have none"),
        ({"method": "codebook", "calibration": "c.txt", "group_size": 24}, "multiple of 16"),
        ({"method": "codebook", "algorithm": "kmeans"}, "Hessian-weighted k-means needs calibration"),
        ({"method": "int8", "bits": 4}, "--bits applies to --method codebook"),
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
