import pytest
import torch

from squeezeserve.kernels import quant_layout as ql


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(5, 37), (64, 576), (3, 1)])
@pytest.mark.parametrize("packed_dim", [0, 1])
def test_pack_round_trips(bits, shape, packed_dim):
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), shape, dtype=torch.int8)
    packed = ql.pack_int32(q, bits, packed_dim)
    per_word = 32 // bits
    expected = (
        (shape[0], -(-shape[1] // per_word)) if packed_dim == 1 else (-(-shape[0] // per_word), shape[1])
    )
    assert packed.dtype == torch.int32 and tuple(packed.shape) == expected
    assert torch.equal(ql.unpack_int32(packed, bits, shape, packed_dim), q)


def test_int4_word_layout_is_lowest_bits_first_offset_binary():
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 4, 7]], dtype=torch.int8)
    word = ql.pack_int32(q, 4)[0, 0].item() & 0xFFFFFFFF
    assert word == sum((v + 8) << (4 * i) for i, v in enumerate(q[0].tolist()))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("packed_dim", [0, 1])
def test_pack_matches_compressed_tensors_bit_for_bit(bits, packed_dim):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (33, 77), dtype=torch.int8)
    ours = ql.pack_int32(q, bits, packed_dim)
    theirs = helpers.pack_to_int32(q, bits, packed_dim)
    assert torch.equal(ours, theirs)
    assert torch.equal(helpers.unpack_from_int32(ours, bits, torch.Size(q.shape), packed_dim), q)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(("bits", "group_size"), [(4, 64), (4, 32), (8, 128)])
def test_quantize_dequantize_error_is_bounded_by_half_a_step(bits, group_size, symmetric):
    weight = torch.randn(48, 576, dtype=torch.float16)
    tensors = ql.pack_weight(weight, bits, group_size, symmetric)
    assert ("weight_zero_point" in tensors) == (not symmetric)
    assert tensors["weight_shape"].tolist() == [48, 576]
    dense = ql.dequantize(
        tensors["weight_packed"], tensors["weight_scale"], tensors.get("weight_zero_point"), (48, 576),
        group_size, bits,
    )  # fmt: skip
    step = tensors["weight_scale"].float().repeat_interleave(group_size, dim=1)[:, :576]
    err = (dense.float() - weight.float()).abs()
    # Round-to-nearest: half a step inside the grid; at the clamped ends (symmetric: +max/scale = 7.5
    # clamps to 7; asymmetric: the rounded zero point shifts the grid) up to one step.
    assert torch.all(err <= step + 1e-3)
    assert (err <= step * 0.5 + 1e-3).float().mean() > 0.98
    assert (err / step).mean() < 0.3


def test_dequantize_matches_compressed_tensors():
    forward = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward_helpers")
    tensors = ql.pack_weight(torch.randn(16, 96, dtype=torch.bfloat16), 4, 32, symmetric=False)
    q = ql.unpack_int32(tensors["weight_packed"], 4, (16, 96))
    zero = ql.unpack_int32(tensors["weight_zero_point"], 4, (16, 3), packed_dim=0)
    expand = lambda t: t.repeat_interleave(32, dim=1)  # noqa: E731
    theirs = forward._dequantize(q, expand(tensors["weight_scale"]), expand(zero))
    ours = ql.dequantize(
        tensors["weight_packed"], tensors["weight_scale"], tensors["weight_zero_point"], (16, 96), 32, 4
    )
    assert torch.equal(ours, theirs)
