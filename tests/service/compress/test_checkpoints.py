"""Compress the bundled baseline with each method once (small calibration slices) and check the outputs:
the quantization_config against vLLM 0.26.0's parsing rules, tensor dtypes/packing/sparsity, loading through
``load_model``, generation, perplexity against the baseline (scored by the validation job's own scorer), and
one compressed checkpoint served by the real embedded worker behind the real gateway."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from compressed_tensors.quantization import ActivationOrdering, QuantizationArgs
from openai import OpenAI
from safetensors.torch import load_file

from squeezeserve.kernels.quant_layout import unpack_int32
from squeezeserve.service.cli import main
from squeezeserve.service.compress.options import DEFAULT_GROUP_SIZE, build_options
from squeezeserve.service.compress.pipeline import compress
from squeezeserve.service.models.loader import load_model
from squeezeserve.service.validate.accuracy import LocalScorer, compare
from squeezeserve.service.validate.data import Window, sliding_windows, tokenize

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

# 16 windows of 256 tokens: 4096, more than twice the widest input (1536), so no Hessian is rank-deficient.
# Measured on this test's slice, GPTQ int4: 1.059x with 16 x 256, 1.103x with 16 x 128 (too few for 1.10x).
CALIBRATION = {"calibration_samples": 16, "calibration_seq_len": 256}
# Perplexity slice: the first 1024 tokens of the test file, windows of 256 scoring 192 new tokens each.
EVAL_TOKENS, EVAL_WINDOW, EVAL_STRIDE = 1024, 256, 192
# vLLM's CompressedTensorsWNA16: symmetric bit widths (uint<b>b<bias>) and those with zero points.
WNA16_BITS = {2, 3, 4, 5, 6, 7, 8}
WNA16_ZP_BITS = {4, 8}

RUNS: dict[str, dict[str, Any]] = {
    "int8": {"method": "int8"},
    "int4-rtn": {"method": "int4", "algorithm": "rtn"},
    "int4-gptq": {"method": "int4", "calibrated": True},
    "fp8": {"method": "fp8"},
    "2of4-int4": {
        "method": "int4",
        "algorithm": "rtn",
        "sparsity": "2:4",
        "recover_steps": 1,
        "recover_batch_size": 1,
        "calibrated": True,
    },
    "prune-0.5": {"method": "prune", "sparsity": "0.5", "prune_method": "magnitude"},
}


class Outputs:
    """Each run compressed on first use, once per module."""

    def __init__(self, baseline: Path, wikitext: Path, root: Path) -> None:
        self.baseline, self.wikitext, self.root = baseline, wikitext, root
        self.paths: dict[str, Path] = {}

    def __getitem__(self, name: str) -> Path:
        if name not in self.paths:
            kwargs = dict(RUNS[name])
            if kwargs.pop("calibrated", False):
                kwargs |= CALIBRATION | {"calibration": str(self.wikitext / "calibration.txt")}
            options = build_options(**kwargs)
            self.paths[name] = compress(str(self.baseline), self.root / name, options).out
        return self.paths[name]


@pytest.fixture(scope="module")
def outputs(baseline_dir: Path, wikitext: Path, tmp_path_factory: pytest.TempPathFactory) -> Outputs:
    return Outputs(baseline_dir, wikitext, tmp_path_factory.mktemp("compressed"))


@pytest.fixture(scope="module")
def windows(baseline_dir: Path, wikitext: Path) -> list[Window]:
    from transformers import AutoTokenizer

    text = (wikitext / "test.txt").read_text(encoding="utf-8")
    ids = tokenize(AutoTokenizer.from_pretrained(baseline_dir), text, EVAL_TOKENS)
    return sliding_windows(ids, EVAL_WINDOW, EVAL_STRIDE)


@pytest.fixture(scope="module")
def accuracy(outputs: Outputs, baseline_dir: Path, windows: list[Window]) -> dict[str, SimpleNamespace]:
    """Perplexity of baseline and candidate and the candidate's top-1 agreement with the baseline, from the
    validation job's own ``compare`` (float32, exact: both models local)."""
    baseline = LocalScorer.load(baseline_dir, dtype="float32")
    result = {}
    for name in ("int8", "int4-rtn", "int4-gptq"):
        candidate = LocalScorer.load(outputs[name], dtype="float32")
        side_b, side_c, fidelity = compare(baseline, candidate, windows)
        result[name] = SimpleNamespace(
            ratio=side_c.perplexity / side_b.perplexity, top1=fidelity.top1_agreement, kl=fidelity.kl_mean
        )
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
        # "group" would make vLLM expect a weight_g_idx tensor; "weight" (or none) leaves the layout as is.
        assert weights.actorder in (None, ActivationOrdering.WEIGHT)
        return f"WNA16 w{weights.num_bits}"
    if fmt == "float-quantized" and inputs is not None:
        floating = weights.type == "float" and inputs.type == "float"
        static_weights = weights.symmetric and not weights.dynamic
        if floating and static_weights and weights.strategy in ("tensor", "channel") and inputs.dynamic:
            return "W8A8Fp8"
    raise AssertionError(f"no vLLM scheme for {config}")


@pytest.mark.parametrize(
    ("name", "scheme"), [("int8", "WNA16 w8"), ("int4-gptq", "WNA16 w4"), ("fp8", "W8A8Fp8")]
)
def test_quantization_config_selects_the_vllm_scheme(outputs: Outputs, name: str, scheme: str) -> None:
    config = quant_config(outputs[name])
    assert vllm_scheme(config) == scheme
    assert "lm_head" in config["ignore"]
    # GPTQ sweeps in activation order by default; RTN (int8 here) has no sweep to order.
    actorder = config["config_groups"]["group_0"]["weights"]["actorder"]
    assert actorder == ("weight" if name == "int4-gptq" else None)


def test_int4_tensors_are_packed_with_scales_and_zero_points(outputs: Outputs) -> None:
    tensors = load_file(str(outputs["int4-gptq"] / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"  # [576, 1536]
    groups = 1536 // DEFAULT_GROUP_SIZE
    assert tensors[f"{name}.weight_packed"].dtype == torch.int32
    assert tensors[f"{name}.weight_packed"].shape == (576, 1536 // 8)
    assert tensors[f"{name}.weight_scale"].dtype == torch.float16
    assert tensors[f"{name}.weight_scale"].shape == (576, groups)
    assert tensors[f"{name}.weight_zero_point"].dtype == torch.int32
    assert tensors[f"{name}.weight_zero_point"].shape == (576 // 8, groups)
    assert tensors[f"{name}.weight_shape"].tolist() == [576, 1536]
    assert f"{name}.weight" not in tensors and "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"].dtype == torch.float16  # unquantized: checkpoint dtype


def test_int8_and_fp8_tensor_dtypes(outputs: Outputs) -> None:
    int8 = load_file(str(outputs["int8"] / "model.safetensors"))
    assert int8["model.layers.3.self_attn.k_proj.weight_packed"].dtype == torch.int32
    assert int8["model.layers.3.self_attn.k_proj.weight_packed"].shape == (192, 576 // 4)
    assert int8["model.layers.3.self_attn.k_proj.weight_scale"].shape == (192, 1)
    assert "model.layers.3.self_attn.k_proj.weight_zero_point" not in int8  # symmetric
    fp8 = load_file(str(outputs["fp8"] / "model.safetensors"))
    assert fp8["model.layers.3.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    assert fp8["model.layers.3.self_attn.k_proj.weight_scale"].dtype == torch.float32
    assert fp8["model.layers.3.self_attn.k_proj.weight_scale"].shape == (192, 1)


def test_two_four_int4_keeps_exactly_two_of_every_four(outputs: Outputs) -> None:
    out = outputs["2of4-int4"]
    tensors = load_file(str(out / "model.safetensors"))
    for layer in range(30):
        for proj in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"):
            name = f"model.layers.{layer}.{proj}"
            rows, k = tensors[f"{name}.weight_shape"].tolist()
            codes = unpack_int32(tensors[f"{name}.weight_packed"], 4, (rows, k)).to(torch.int32)
            groups = tensors[f"{name}.weight_scale"].shape[1]
            zero = unpack_int32(tensors[f"{name}.weight_zero_point"], 4, (rows, groups), packed_dim=0)
            nonzero = codes != zero.to(torch.int32).repeat_interleave(k // groups, dim=1)
            assert torch.equal(nonzero.view(rows, k // 4, 4).sum(-1), torch.full((rows, k // 4), 2)), name
    record = json.loads((out / "squeeze.json").read_text())
    assert record["options"]["recover_steps"] == 1
    assert record["sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert len(record["calibration"]["sha256"]) == 64


def test_pruned_dense_checkpoint_is_half_zero_and_has_no_quantization(outputs: Outputs) -> None:
    out = outputs["prune-0.5"]
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    weight = load_file(str(out / "model.safetensors"))["model.layers.5.mlp.up_proj.weight"]
    assert weight.dtype == torch.float16
    assert torch.equal((weight == 0).sum(dim=1), torch.full((weight.shape[0],), weight.shape[1] // 2))


@pytest.mark.parametrize("name", list(RUNS))
def test_every_output_loads_and_generates_like_the_baseline(
    outputs: Outputs, baseline_dir: Path, name: str
) -> None:
    prompt = "The capital of France is"
    texts = []
    for path in (baseline_dir, outputs[name]):
        loaded = load_model(path, dtype="float32")
        ids = loaded.tokenizer(prompt, return_tensors="pt").input_ids
        generated = loaded.model.generate(ids, max_new_tokens=4, do_sample=False)
        texts.append(loaded.tokenizer.decode(generated[0, ids.shape[1] :]))
    assert len(texts[1].strip()) > 0
    if name in ("int8", "fp8"):  # near-lossless: the greedy continuation of a plain fact does not move
        assert texts[1] == texts[0]


def test_int8_perplexity_within_one_percent(accuracy: dict[str, SimpleNamespace]) -> None:
    # The issue's bound. Per-channel int8 moves each weight by at most half of 1/127 of its row's range.
    assert accuracy["int8"].ratio <= 1.01


def test_int4_gptq_meets_the_issue_bound_and_beats_rtn(accuracy: dict[str, SimpleNamespace]) -> None:
    """GPTQ and RTN at the default group size (32), the issue's bounds: perplexity <= 1.10x the baseline and
    below RTN's. The baseline was dequantized from GGUF Q4_1 (per 32 weights a scale and a *float* minimum)
    and vLLM's int4 zero points are integers, so min/max parameters leave every group up to half a step off
    its lattice; GPTQ's searched scales and actorder are what bring it under 1.10x. Measured on this slice
    (16 x 256 calibration tokens): GPTQ 1.059x, KL 0.082, top-1 0.845; RTN 1.157x, KL 0.252, top-1 0.747."""
    gptq, rtn = accuracy["int4-gptq"], accuracy["int4-rtn"]
    assert gptq.ratio <= 1.10
    assert gptq.ratio < rtn.ratio
    assert gptq.kl < rtn.kl
    assert gptq.top1 > rtn.top1


@pytest.fixture(scope="module")
def gateway_over_int4(outputs: Outputs, servers: SimpleNamespace) -> Iterator[str]:
    """The int4 GPTQ checkpoint in the real embedded worker, behind the real gateway (both subprocesses)."""
    worker_url, worker = servers.start_worker(outputs["int4-gptq"], "smollm2-int4")
    port = servers.free_port()
    command = [sys.executable, "-m", "squeezeserve.service.cli", "--log-level", "WARNING", "gateway"]
    gateway = subprocess.Popen([*command, "--upstream", worker_url, "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        servers.wait_until_healthy(url, timeout=60, process=gateway)
        yield url
    finally:
        servers.stop_process(gateway)
        servers.stop_process(worker)


def test_int4_checkpoint_answers_through_the_gateway(gateway_over_int4: str) -> None:
    client = OpenAI(base_url=f"{gateway_over_int4}/v1", api_key="unused", timeout=120)
    assert [m.id for m in client.models.list().data] == ["smollm2-int4"]
    reply = client.chat.completions.create(
        model="smollm2-int4",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0.0,
    )
    assert reply.choices[0].message.content.strip()
    assert reply.usage is not None and reply.usage.completion_tokens > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/nonexistent/model", "--method", "int8"], "not found"),
        (["--method", "int3"], "unknown method"),
        (["--method", "fp8", "--sparsity", "2:4"], "fp8 does not combine"),
        (["--method", "int4", "--algorithm", "rtn", "--group-size", "100"], "does not divide"),
        (["--method", "int8", "--device", "gpu0"], "unknown --device"),
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
