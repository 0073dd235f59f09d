"""Low-rank factorization and weight sharing: the algorithms on small tensors, and ``squeezeserve compress
--method lowrank|codebook`` end to end on a tiny random Llama (the bundled model's tokenizer, so the shipped
calibration text tokenizes as it does for the real model): checkpoint format, loading, arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from squeezeserve.kernels import codebook_layout
from squeezeserve.kernels.checkpoint_format import CodebookFormat, LowRankFormat, read_format
from squeezeserve.kernels.modules import CodebookLinear, LowRankLinear
from squeezeserve.service.cli import main
from squeezeserve.service.compress.codebook import codebook_quantize, weighted_kmeans
from squeezeserve.service.compress.lowrank import allocate_ranks, factorize, input_scaling, whitening
from squeezeserve.service.compress.options import build_options
from squeezeserve.service.compress.pipeline import compress
from squeezeserve.service.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CALIBRATION = {
    "calibration": "sample:wikitext-2-calibration",
    "calibration_samples": 4,
    "calibration_seq_len": 64,
}


def correlated_inputs(tokens: int, width: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose channels differ in scale by ~100x and are correlated: where calibration pays."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-1, 1, width)[torch.randperm(width, generator=gen)]
    return (
        torch.randn(tokens, width, generator=gen) @ torch.randn(width, width, generator=gen) * 0.2
    ) * scales


def output_error(x: torch.Tensor, weight: torch.Tensor, approximation: torch.Tensor) -> float:
    return float(torch.linalg.norm(x @ (weight - approximation).T) / torch.linalg.norm(x @ weight.T))


# --- low-rank ----------------------------------------------------------------------------------------


def test_activation_aware_factors_have_lower_output_error_than_plain_svd() -> None:
    x = correlated_inputs(2048, 64)
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    covariance = x.T @ x / x.shape[0]
    errors = {}
    for algorithm in ("svd", "asvd", "svdllm"):
        linear = torch.nn.Linear(64, 48, bias=False)
        linear.weight.data.copy_(weight)
        factored = factorize({"l": linear}, 0.5, algorithm, {"l": covariance})
        u, v = factored.factors["l"]
        errors[algorithm] = output_error(x, weight, u @ v)
        torch.testing.assert_close(linear.weight.data, u @ v)  # the module holds what the checkpoint will
    assert errors["asvd"] < 0.8 * errors["svd"], errors
    # Whitening makes the truncation optimal for the output error (up to its small damping).
    assert errors["svdllm"] < errors["asvd"], errors


def test_whitened_truncation_error_is_the_dropped_singular_values() -> None:
    x = correlated_inputs(4096, 32)
    weight = torch.randn(24, 32, generator=torch.Generator().manual_seed(1))
    covariance = x.T @ x / x.shape[0]
    lower = whitening(covariance)
    sigma = torch.linalg.svdvals(weight @ lower)
    linear = torch.nn.Linear(32, 24, bias=False)
    linear.weight.data.copy_(weight)
    u, v = factorize({"l": linear}, 0.5, "svdllm", {"l": covariance}).factors["l"]
    rank = u.shape[1]
    damped = lower @ lower.T  # H + its damping: what the whitening factors
    error = torch.trace((weight - u @ v) @ damped @ (weight - u @ v).T)
    torch.testing.assert_close(error, sigma[rank:].square().sum(), rtol=1e-3, atol=1e-4)


def test_ranks_meet_the_budget_and_go_where_the_energy_is() -> None:
    # Two layers of the same shape: one spectrum decays fast (few ranks hold its energy), one is flat.
    decaying = (torch.tensor([0.5]) ** torch.arange(32)).float()
    flat = torch.ones(32)
    spectra = {"decaying": (decaying, 64, 32), "flat": (flat, 64, 32)}
    ranks = allocate_ranks(spectra, 0.4)
    spent = sum(r * (64 + 32) for r in ranks.values() if r is not None)
    assert spent <= 0.4 * 2 * 64 * 32
    assert ranks["flat"] > ranks["decaying"] >= 1
    # Where a layer's factors would be as large as its weight (rank 21 of 64 x 32), it stays dense.
    generous = allocate_ranks(spectra, 0.9)
    assert generous["flat"] is None and 3 <= generous["decaying"] < 21


def test_dead_input_channels_do_not_break_the_scaling() -> None:
    scale = input_scaling(torch.tensor([0.0, 4.0, 0.25]))
    torch.testing.assert_close(scale, torch.tensor([0.5, 2.0, 0.5]))


# --- codebooks ---------------------------------------------------------------------------------------


def test_weighted_kmeans_favours_the_heavy_weights() -> None:
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(8, 256, generator=gen)
    values[:, :32] = torch.rand(8, 32, generator=gen) * 0.5  # the important weights sit in one narrow range
    heavy = torch.zeros(8, 256)
    heavy[:, :32] = 100.0
    plain = weighted_kmeans(values, torch.ones(8, 256), 4)
    weighted = weighted_kmeans(values, heavy + 0.01, 4)

    def heavy_error(codebook: torch.Tensor) -> float:
        index = torch.searchsorted(
            ((codebook[:, 1:] + codebook[:, :-1]) / 2).contiguous(), values.contiguous()
        )
        return float((values - codebook.gather(1, index))[:, :32].square().sum())

    assert heavy_error(weighted) < 0.2 * heavy_error(plain)
    assert torch.equal(weighted, weighted.to(torch.float16).float())  # values the checkpoint holds exactly


def test_kmeans_finds_every_value_of_a_row_with_few_distinct_values() -> None:
    """Rows as GGUF Q4_1 blocks are: 32 weights on a 16-level grid, some levels repeated, some absent. Starts
    at quantiles land twice on a repeated value; the emptied entry must move to where the error is."""
    gen = torch.Generator().manual_seed(0)
    levels = torch.randint(0, 16, (64, 32), generator=gen).float()
    values = (levels * 0.01 - 0.07).to(torch.float16).float()  # float16-exact, as checkpoint weights are
    codebook = weighted_kmeans(values, torch.ones_like(values), 16)
    index = torch.searchsorted(((codebook[:, 1:] + codebook[:, :-1]) / 2).contiguous(), values.contiguous())
    assert torch.equal(codebook.gather(1, index), values)


@pytest.mark.parametrize("group_size", [None, 32])
@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_onto_codebooks_beats_nearest_value(bits: int, group_size: int | None) -> None:
    # (a seeded weight: the test's verdict must not depend on the tests before it. 96 rows: over 12 seeds
    # GPTQ's error was 0.77-0.89x nearest value's in every case, 4 bits in groups of 32 the closest; on 24
    # rows one order of the suite gave 0.92x there)
    x = correlated_inputs(2048, 64)
    weight = torch.randn(96, 64, generator=torch.Generator().manual_seed(1))
    gram = x.T @ x
    errors = {}
    for algorithm in ("kmeans", "gptq"):
        shared = codebook_quantize(weight, gram, bits, group_size, algorithm)
        assert int(shared.indices.max()) < 1 << bits and shared.codebook.dtype == torch.float16
        groups = 1 if group_size is None else 64 // group_size
        assert shared.codebook.shape == (96, groups << bits)
        packed = codebook_layout.pack_indices(shared.indices, bits)
        assert torch.equal(
            codebook_layout.dequantize(packed, shared.codebook, 64, group_size, bits).float(),
            shared.dequantize(),
        )
        errors[algorithm] = output_error(x, weight, shared.dequantize())
    assert errors["gptq"] < 0.9 * errors["kmeans"], errors


# --- end to end on a tiny random Llama -----------------------------------------------------------------


def dense_with(source: Path, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The source model in float32 with the given Linears' weights replaced."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    for name, weight in weights.items():
        model.get_submodule(name).weight.data.copy_(weight)
    return model


@torch.no_grad()
def test_lowrank_checkpoint_declares_its_ranks_and_loads_as_two_gemms(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    options = build_options(method="lowrank", rank_ratio=0.5, **CALIBRATION)
    result = compress(str(tiny_checkpoint), tmp_path / "lr", options)
    config = json.loads((tmp_path / "lr" / "config.json").read_text())
    fmt = read_format(config)
    assert isinstance(fmt, LowRankFormat) and fmt.ranks and fmt.ignore == ("lm_head",)
    parameters = result.record["lowrank"]["parameters"]
    assert parameters["after"] <= 0.5 * parameters["before"]
    tensors = load_file(tmp_path / "lr" / "model.safetensors")
    for name, rank in fmt.ranks.items():
        assert tensors[f"{name}.weight_u"].shape[1] == rank == tensors[f"{name}.weight_v"].shape[0]
        assert f"{name}.weight" not in tensors
    loaded = load_model(tmp_path / "lr", dtype="float32", use_custom_ops=False)
    factored = {n: m for n, m in loaded.model.named_modules() if isinstance(m, LowRankLinear)}
    assert {n: m.rank for n, m in factored.items()} == fmt.ranks
    reference = dense_with(
        tiny_checkpoint,
        {n: tensors[f"{n}.weight_u"].float() @ tensors[f"{n}.weight_v"].float() for n in factored},
    )
    ids = torch.randint(0, 49152, (2, 12))
    torch.testing.assert_close(loaded.model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize(("bits", "algorithm", "group_size"), [(4, "gptq", None), (3, "kmeans", 32)])
def test_codebook_checkpoint_loads_and_runs_the_codebook_op(
    tiny_checkpoint: Path, tmp_path: Path, bits: int, algorithm: str, group_size: int | None
) -> None:
    options = build_options(
        method="codebook", bits=bits, algorithm=algorithm, group_size=group_size, **CALIBRATION
    )
    compress(str(tiny_checkpoint), tmp_path / "cb", options)
    fmt = read_format(json.loads((tmp_path / "cb" / "config.json").read_text()))
    assert fmt == CodebookFormat(bits=bits, group_size=group_size, ignore=("lm_head",))
    kept = load_model(tmp_path / "cb", dtype="float32", use_custom_ops=False, quantized_linear="kernel")
    shared = {n: m for n, m in kept.model.named_modules() if isinstance(m, CodebookLinear)}
    assert len(shared) == 2 * 7  # every decoder Linear of both layers
    expanded = load_model(
        tmp_path / "cb", dtype="float32", use_custom_ops=False, quantized_linear="dequantize"
    )
    assert not any(isinstance(m, CodebookLinear) for m in expanded.model.modules())
    reference = dense_with(tiny_checkpoint, {n: m.dequantized_weight().float() for n, m in shared.items()})
    ids = torch.randint(0, 49152, (2, 12))
    for model in (kept.model, expanded.model):
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)


def test_cli_compresses_lowrank_and_refuses_a_missing_rank_ratio(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["compress", "--model", str(tiny_checkpoint), "--method", "lowrank", "--algorithm", "svd"]
    assert main([*base, "--out", str(tmp_path / "bad")]) == 2
    assert "needs --rank-ratio" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    assert main([*base, "--rank-ratio", "0.6", "--out", str(tmp_path / "svd"), "--threads", "1"]) == 0
    assert read_format(json.loads((tmp_path / "svd" / "config.json").read_text())).ranks
