"""The vLLM quantization method's arithmetic and checkpoint handling, on CPU without vLLM.

What vLLM adds at serving time is loading: for a merged layer (qkv_proj, gate_up_proj) its loader writes
each shard's checkpoint tensors into consecutive output rows of one parameter. These tests build exactly
that from per-shard checkpoint tensors and check that ``quant_linear`` on the stacked tensors equals the
shards' dequantized weights stacked and multiplied in plain PyTorch -- through the reference path and
through the Triton kernel under the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from squeezeserve.kernels import quant_layout, registry, vllm_ops
from squeezeserve.service.compress.formats import quantization_config
from squeezeserve.service.compress.quantize import QuantScheme


def _config(bits: int, group_size: int | None, symmetric: bool, kind: str = "int") -> dict:
    return quantization_config(QuantScheme(kind=kind, bits=bits, group_size=group_size, symmetric=symmetric))


@pytest.mark.parametrize(
    ("bits", "group_size", "symmetric"), [(4, 32, False), (4, 128, True), (8, None, True)]
)
def test_parse_scheme_reads_what_compress_writes(bits, group_size, symmetric):
    scheme = vllm_ops.parse_scheme(_config(bits, group_size, symmetric))
    assert scheme == vllm_ops.WeightOnlyScheme(bits, group_size, symmetric, ("lm_head",))


def test_parse_scheme_refuses_fp8_with_the_reason():
    with pytest.raises(ValueError, match="integer weight-only"):
        vllm_ops.parse_scheme(_config(8, None, True, kind="float"))


def test_parse_scheme_refuses_activation_reordering():
    config = _config(4, 32, True)
    config["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    with pytest.raises(ValueError, match="actorder"):
        vllm_ops.parse_scheme(config)


def test_asymmetric_shards_must_fill_whole_zero_point_words():
    scheme = vllm_ops.WeightOnlyScheme(4, 32, False, ())
    vllm_ops.check_partition(scheme, [64, 32, 32])
    with pytest.raises(ValueError, match="multiple of 8"):
        vllm_ops.check_partition(scheme, [64, 36])
    vllm_ops.check_partition(vllm_ops.WeightOnlyScheme(4, 32, True, ()), [64, 36])  # no zero points


def _stacked_checkpoint(shards: list[torch.Tensor], scheme: vllm_ops.WeightOnlyScheme):
    """What vLLM's loader leaves in a merged layer: each shard's checkpoint tensors stacked along the output
    dim (zero points are packed along it, so their int32 rows stack)."""
    group = scheme.group_size_for(shards[0].shape[1])
    packed = [quant_layout.pack_weight(w, scheme.bits, group, scheme.symmetric) for w in shards]
    stacked = {
        name: torch.cat([p[name] for p in packed])
        for name in ("weight_packed", "weight_scale", "weight_zero_point")
        if name in packed[0]
    }
    dense = torch.cat([
        quant_layout.dequantize(
            p["weight_packed"], p["weight_scale"], p.get("weight_zero_point"), tuple(w.shape), group,
            scheme.bits,
        )
        for p, w in zip(packed, shards, strict=True)
    ])  # fmt: skip
    return stacked, dense


CASES = [
    # qkv-like shards (q 64, k 32, v 32), int4 asymmetric group 32 -- squeezeserve compress's int4 default
    (vllm_ops.WeightOnlyScheme(4, 32, False, ()), [64, 32, 32], 96),
    # gate_up-like, int4 symmetric group 128 over K = 256 (two groups)
    (vllm_ops.WeightOnlyScheme(4, 128, True, ()), [48, 48], 256),
    # int8 per channel (one group as wide as K), K not a multiple of the 4-per-word packing
    (vllm_ops.WeightOnlyScheme(8, None, True, ()), [40, 24], 70),
]


@pytest.mark.parametrize("triton", [False, True], ids=["reference", "triton-interpreter"])
@pytest.mark.parametrize(("scheme", "widths", "k_in"), CASES)
def test_quant_linear_on_stacked_shards_equals_dequantize_then_matmul(scheme, widths, k_in, triton):
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float16
    shards = [(torch.randn(n, k_in, generator=gen) * 0.05).to(dtype) for n in widths]
    stacked, dense = _stacked_checkpoint(shards, scheme)
    x = torch.randn(5, k_in, generator=gen).to(dtype)
    bias = torch.randn(sum(widths), generator=gen).to(dtype)
    with registry.triton_on_cpu(triton):
        y = vllm_ops.quant_linear(
            x,
            stacked["weight_packed"],
            stacked["weight_scale"],
            stacked.get("weight_zero_point"),
            scheme,
            bias,
        )
    expected = x.float() @ dense.float().T + bias.float()
    assert y.shape == (5, sum(widths)) and y.dtype == dtype
    # Both sides multiply the same fp16 values; they differ by the fp32 summation order and the final fp16
    # rounding of y (|y| ~ 1: half an ulp is 5e-4). A wrong shard offset or nibble order is off by O(|y|).
    torch.testing.assert_close(y.float(), expected, rtol=2e-3, atol=2e-3)


def test_quant_linear_counts_its_calls():
    scheme = vllm_ops.WeightOnlyScheme(8, None, True, ())
    stacked, _ = _stacked_checkpoint([torch.randn(8, 16, dtype=torch.float16)], scheme)
    before = vllm_ops.call_counts().get("quant_matmul", 0)
    vllm_ops.quant_linear(
        torch.randn(2, 16, dtype=torch.float16),
        stacked["weight_packed"],
        stacked["weight_scale"],
        None,
        scheme,
    )
    assert vllm_ops.call_counts()["quant_matmul"] == before + 1
