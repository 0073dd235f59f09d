"""Compress the bundled baseline with each method once (small calibration slices) and check the outputs:
the quantization_config against vLLM 0.26.0's parsing rules, tensor dtypes/packing/sparsity, loading through
``load_model``, generation, and perplexity against the baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from safetensors.torch import load_file

from squeezeserve.kernels.quant_layout import unpack_int32
from squeezeserve.service.cli import main
from squeezeserve.service.compress.evaluate import evaluate, text_windows
from squeezeserve.service.compress.options import build_options
from squeezeserve.service.compress.pipeline import compress
from squeezeserve.service.models.loader import load_model

pytestmark = pytest.mark.slow

WIKITEXT = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "wikitext-2"
CALIBRATION = {
    "calibration": str(WIKITEXT / "calibration.txt"),
    "calibration_samples": 16,
    "calibration_seq_len": 128,
}
# vLLM's CompressedTensorsWNA16: symmetric bit widths (uint<b>b<bias>) and those with zero points.
WNA16_BITS = {2, 3, 4, 5, 6, 7, 8}
WNA16_ZP_BITS = {4, 8}

RUNS = {
    "int8": {"method": "int8"},
    "int4-rtn": {"method": "int4", "algorithm": "rtn"},
    "int4-gptq": {"method": "int4", **CALIBRATION},
    "fp8": {"method": "fp8"},
    "2of4-int4": {
        "method": "int4",
        "algorithm": "rtn",
        "sparsity": "2:4",
        "recover_steps": 1,
        "recover_batch_size": 1,
        **CALIBRATION,
    },
    "prune-0.5": {"method": "prune", "sparsity": "0.5", "prune_method": "magnitude"},
}


@pytest.fixture(scope="module")
def outputs(baseline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compressed")
    return {
        name: compress(str(baseline_dir), root / name, build_options(**kwargs)).out
        for name, kwargs in RUNS.items()
    }


@pytest.fixture(scope="module")
def windows(baseline_dir: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    return text_windows(
        WIKITEXT / "test.txt", AutoTokenizer.from_pretrained(baseline_dir), seq_len=128, max_windows=16
    )


@pytest.fixture(scope="module")
def perplexities(outputs: dict[str, Path], baseline_dir: Path, windows: torch.Tensor) -> dict[str, float]:
    result = {"baseline": evaluate(load_model(baseline_dir, dtype="float32").model, windows).perplexity}
    for name in ("int8", "int4-rtn", "int4-gptq"):
        result[name] = evaluate(load_model(outputs[name], dtype="float32").model, windows).perplexity
    return result


def quant_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


def vllm_scheme(config: dict) -> str:
    """Which vLLM 0.26.0 compressed-tensors scheme the config selects (CompressedTensorsConfig's rules)."""
    assert config["quant_method"] == "compressed-tensors"
    assert not config.get("sparsity_config"), "vLLM 0.26 raises on a sparsity_config with targets"
    (group,) = config["config_groups"].values()
    assert group["targets"] == ["Linear"]
    weights = QuantizationArgs.model_validate(group["weights"])
    inputs = group.get("input_activations")
    inputs = None if inputs is None else QuantizationArgs.model_validate(inputs)
    fmt = group.get("format") or config["format"]
    if (
        fmt == "pack-quantized"
        and inputs is None
        and weights.strategy in ("channel", "group")
        and not weights.dynamic
    ):
        assert weights.num_bits in (WNA16_BITS if weights.symmetric else WNA16_ZP_BITS)
        assert weights.strategy == "channel" or weights.group_size
        return f"WNA16 w{weights.num_bits}"
    if fmt == "float-quantized" and inputs is not None:
        floating = weights.type == "float" and inputs.type == "float"
        if (
            floating
            and weights.symmetric
            and not weights.dynamic
            and weights.strategy in ("tensor", "channel")
        ):
            if inputs.dynamic:
                return "W8A8Fp8"
    raise AssertionError(f"no vLLM scheme for {config}")


@pytest.mark.parametrize(
    ("name", "scheme"), [("int8", "WNA16 w8"), ("int4-gptq", "WNA16 w4"), ("fp8", "W8A8Fp8")]
)
def test_quantization_config_selects_the_vllm_scheme(
    outputs: dict[str, Path], name: str, scheme: str
) -> None:
    config = quant_config(outputs[name])
    assert vllm_scheme(config) == scheme
    assert "lm_head" in config["ignore"]


def test_int4_tensors_are_packed_with_scales_and_zero_points(outputs: dict[str, Path]) -> None:
    tensors = load_file(str(outputs["int4-gptq"] / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"  # [576, 1536]
    assert tensors[f"{name}.weight_packed"].dtype == torch.int32
    assert tensors[f"{name}.weight_packed"].shape == (576, 1536 // 8)
    assert tensors[f"{name}.weight_scale"].dtype == torch.float16
    assert tensors[f"{name}.weight_scale"].shape == (576, 1536 // 32)
    assert tensors[f"{name}.weight_zero_point"].shape == (576 // 8, 1536 // 32)
    assert tensors[f"{name}.weight_shape"].tolist() == [576, 1536]
    assert f"{name}.weight" not in tensors and "lm_head.weight" not in tensors


def test_int8_and_fp8_tensor_dtypes(outputs: dict[str, Path]) -> None:
    int8 = load_file(str(outputs["int8"] / "model.safetensors"))
    assert int8["model.layers.3.self_attn.k_proj.weight_packed"].shape == (192, 576 // 4)
    assert int8["model.layers.3.self_attn.k_proj.weight_scale"].shape == (192, 1)
    fp8 = load_file(str(outputs["fp8"] / "model.safetensors"))
    assert fp8["model.layers.3.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    assert fp8["model.layers.3.self_attn.k_proj.weight_scale"].dtype == torch.float32
    assert fp8["model.layers.3.self_attn.k_proj.weight_scale"].shape == (192, 1)


def test_two_four_int4_keeps_exactly_two_of_every_four(outputs: dict[str, Path]) -> None:
    tensors = load_file(str(outputs["2of4-int4"] / "model.safetensors"))
    for layer in (0, 29):
        for proj in ("self_attn.q_proj", "mlp.down_proj"):
            name = f"model.layers.{layer}.{proj}"
            out, k = tensors[f"{name}.weight_shape"].tolist()
            codes = unpack_int32(tensors[f"{name}.weight_packed"], 4, (out, k)).to(torch.int32)
            groups = tensors[f"{name}.weight_scale"].shape[1]
            zero = unpack_int32(tensors[f"{name}.weight_zero_point"], 4, (out, groups), packed_dim=0)
            nonzero = codes != zero.to(torch.int32).repeat_interleave(k // groups, dim=1)
            assert torch.equal(nonzero.view(out, k // 4, 4).sum(-1), torch.full((out, k // 4), 2))
    record = json.loads((outputs["2of4-int4"] / "squeeze.json").read_text())
    assert record["options"]["recover_steps"] == 1 and record["sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert len(record["calibration"]["sha256"]) == 64


def test_pruned_dense_checkpoint_is_half_zero_and_has_no_quantization(outputs: dict[str, Path]) -> None:
    out = outputs["prune-0.5"]
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    weight = load_file(str(out / "model.safetensors"))["model.layers.5.mlp.up_proj.weight"]
    assert weight.dtype == torch.float16
    assert torch.equal((weight == 0).sum(dim=1), torch.full((weight.shape[0],), weight.shape[1] // 2))


@pytest.mark.parametrize("name", list(RUNS))
def test_every_output_loads_and_generates(outputs: dict[str, Path], name: str) -> None:
    loaded = load_model(outputs[name], dtype="float32")
    ids = loaded.tokenizer("The capital of France is", return_tensors="pt").input_ids
    generated = loaded.model.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 4


def test_int8_perplexity_within_one_percent(perplexities: dict[str, float]) -> None:
    assert perplexities["int8"] <= 1.01 * perplexities["baseline"]


def test_int4_gptq_within_ten_percent_and_better_than_rtn(perplexities: dict[str, float]) -> None:
    assert perplexities["int4-gptq"] <= 1.10 * perplexities["baseline"]
    assert perplexities["int4-gptq"] < perplexities["int4-rtn"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/nonexistent/model", "--method", "int8"], "not found"),
        (["--method", "int3"], "unknown method"),
        (["--method", "fp8", "--sparsity", "2:4"], "fp8 does not combine"),
        (["--method", "int4", "--algorithm", "rtn", "--group-size", "100"], "does not divide"),
    ],
)
def test_bad_input_exits_nonzero_and_writes_nothing(
    baseline_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str], message: str
) -> None:
    if "--model" not in argv:
        argv = ["--model", str(baseline_dir), *argv]
    out = tmp_path / "out"
    assert main(["compress", *argv, "--out", str(out)]) != 0
    assert message in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.iterdir()) == []
