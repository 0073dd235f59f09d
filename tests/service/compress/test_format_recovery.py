"""Recovery after low-rank factoring and weight sharing (format_recovery.py) on a tiny random Llama: the
format's own parameters (factors, codebook values) train towards the teacher, everything else stays as it
was, and ``compress --recover-steps`` writes the trained format."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from squeezeserve.kernels import reference
from squeezeserve.kernels.checkpoint_format import CodebookFormat, read_format
from squeezeserve.kernels.modules import CodebookLinear
from squeezeserve.service.cli import main
from squeezeserve.service.compress.calibration import Calibration
from squeezeserve.service.compress.codebook import codebook_quantize
from squeezeserve.service.compress.format_recovery import recover_codebooks, recover_factors
from squeezeserve.service.compress.lowrank import factorize
from squeezeserve.service.compress.options import build_options
from squeezeserve.service.compress.pipeline import compress, target_linears
from squeezeserve.service.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 25


def teacher_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        tie_word_embeddings=True,
        initializer_range=0.1,  # peaked outputs: the KL to compress away is well above rounding noise
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def options(method: str, **extra):
    return build_options(
        method=method,
        calibration="sample:wikitext-2-calibration",
        recover_steps=STEPS,
        recover_lr=1e-3,
        recover_batch_size=4,
        **extra,
    )


def calibration() -> Calibration:
    ids = torch.randint(0, 64, (16, 24), generator=torch.Generator().manual_seed(1))
    return Calibration(input_ids=ids, path="random", sha256="-")


@torch.no_grad()
def kl_to_teacher(student, teacher, ids) -> float:
    hs = student.model(input_ids=ids).last_hidden_state.flatten(0, 1)
    ht = teacher.model(input_ids=ids).last_hidden_state.flatten(0, 1)
    return float(reference.linear_kd(hs, student.lm_head.weight, ht, teacher.lm_head.weight))


def frozen_state(model) -> dict[str, torch.Tensor]:
    """Everything recovery must leave alone: every parameter but the decoder Linears' weights."""
    linears = {f"{name}.weight" for name in target_linears(model)}
    return {k: v.clone() for k, v in model.state_dict().items() if k not in linears}


def test_codebook_values_train_towards_the_teacher_and_indices_stay() -> None:
    teacher = teacher_model()
    student = copy.deepcopy(teacher)
    shared = {}
    for name, linear in target_linears(student).items():
        gram = torch.eye(linear.in_features)
        shared[name] = codebook_quantize(linear.weight, gram, bits=3, group_size=None, algorithm="kmeans")
        linear.weight.data = shared[name].dequantize()
    before_state = frozen_state(student)
    indices = {name: q.indices.clone() for name, q in shared.items()}
    codebooks = {name: q.codebook.clone() for name, q in shared.items()}
    data = calibration()
    before = kl_to_teacher(student, teacher, data.input_ids)

    record = recover_codebooks(student, teacher, shared, data, options("codebook", bits=3))

    assert record["steps"] == STEPS and record["trained"] == "codebook values"
    assert record["parameters"] == sum(q.codebook.numel() for q in shared.values())
    assert kl_to_teacher(student, teacher, data.input_ids) < 0.7 * before
    for name, linear in target_linears(student).items():
        assert type(linear) is torch.nn.Linear and not linear.weight.requires_grad  # swapped back, frozen
        assert torch.equal(shared[name].indices, indices[name])
        assert shared[name].codebook.dtype == torch.float16
        assert not torch.equal(shared[name].codebook, codebooks[name])
        # the model computes with exactly what the checkpoint will hold
        assert torch.equal(linear.weight, shared[name].dequantize())
    after_state = frozen_state(student)
    assert all(torch.equal(after_state[k], v) for k, v in before_state.items())


def test_low_rank_factors_train_towards_the_teacher_at_their_ranks() -> None:
    teacher = teacher_model()
    student = copy.deepcopy(teacher)
    factored = factorize(target_linears(student), 0.4, "svd")
    assert factored.factors
    shapes = {name: (u.shape, v.shape) for name, (u, v) in factored.factors.items()}
    before_state = frozen_state(student)
    data = calibration()
    before = kl_to_teacher(student, teacher, data.input_ids)

    record = recover_factors(student, teacher, factored.factors, data, options("lowrank", rank_ratio=0.4))

    assert record["trained"] == "low-rank factors" and record["steps"] == STEPS
    assert kl_to_teacher(student, teacher, data.input_ids) < 0.7 * before
    for name, (u, v) in factored.factors.items():
        assert (u.shape, v.shape) == shapes[name]
        torch.testing.assert_close(student.get_submodule(name).weight, u @ v)
    after_state = frozen_state(student)
    assert all(torch.equal(after_state[k], v) for k, v in before_state.items())


def test_kd_is_the_default_recovery_of_lowrank_and_codebooks() -> None:
    for method, extra in (("codebook", {"bits": 4}), ("lowrank", {"rank_ratio": 0.5})):
        built = build_options(
            method=method, **extra, recover_steps=1, calibration="sample:wikitext-2-calibration"
        )
        assert built.recover_loss == "kd" and built.recovers_format
    int4 = build_options(method="int4", calibration="sample:wikitext-2-calibration")
    assert not int4.recovers_format
    with pytest.raises(ValueError, match="pruned, factored or weight-shared"):
        build_options(method="int4", recover_steps=1, calibration="sample:wikitext-2-calibration")


def test_compress_writes_the_recovered_codebooks(tiny_checkpoint: Path, tmp_path: Path) -> None:
    calibration_options = {
        "calibration": "sample:wikitext-2-calibration",
        "calibration_samples": 4,
        "calibration_seq_len": 32,
    }
    plain = compress(
        str(tiny_checkpoint), tmp_path / "plain", build_options(method="codebook", **calibration_options)
    )
    recovered = compress(
        str(tiny_checkpoint),
        tmp_path / "recovered",
        build_options(method="codebook", recover_steps=3, recover_lr=1e-3, **calibration_options),
    )
    assert "recovery" not in plain.record
    assert recovered.record["recovery"]["steps"] == 3 and recovered.record["recovery"]["loss"] == "kd"
    assert recovered.record["options"]["recover_steps"] == 3
    config = json.loads((tmp_path / "recovered" / "config.json").read_text())
    assert read_format(config) == CodebookFormat(bits=4, group_size=None, ignore=("lm_head",))
    before, after = (load_file(tmp_path / run / "model.safetensors") for run in ("plain", "recovered"))
    assert before.keys() == after.keys()
    changed = 0
    for key, tensor in after.items():
        assert tensor.shape == before[key].shape and tensor.dtype == before[key].dtype
        if key.endswith(".weight_indices"):  # same calibration, same fit: only the values trained
            assert torch.equal(tensor, before[key])
        elif key.endswith(".weight_codebook"):
            changed += not torch.equal(tensor, before[key])
        else:
            assert torch.equal(tensor, before[key]), key
    assert changed == 2 * 7  # every decoder Linear's codebooks
    loaded = load_model(
        tmp_path / "recovered", dtype="float32", use_custom_ops=False, quantized_linear="kernel"
    )
    assert sum(isinstance(m, CodebookLinear) for m in loaded.model.modules()) == 2 * 7
    assert torch.isfinite(loaded.model(torch.randint(0, 49152, (1, 8))).logits).all()
    # A separate distill run cannot take the compressed checkpoint; the error says where recovery goes.
    distill = build_options(
        method="distill", teacher=str(tiny_checkpoint), recover_steps=1, **calibration_options
    )
    with pytest.raises(ValueError, match="--recover-steps N trains its factors or codebook values"):
        compress(str(tmp_path / "plain"), tmp_path / "distilled", distill)
    assert not (tmp_path / "distilled").exists()


def test_cli_recovers_factors_and_says_so(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "lr"
    command = ["compress", "--model", str(tiny_checkpoint), "--method", "lowrank", "--rank-ratio", "0.5"]
    command += ["--calibration", "sample:wikitext-2-calibration", "--calibration-samples", "4"]
    command += ["--calibration-seq-len", "32", "--recover-steps", "2", "--out", str(out), "--threads", "1"]
    assert main(command) == 0
    assert "recovery (kd, low-rank factors): 2 steps" in capsys.readouterr().out
    record = json.loads((out / "squeeze.json").read_text())
    assert record["recovery"]["trained"] == "low-rank factors"
    assert record["options"]["recover_lr"] == 1e-4  # the formats' default, not pruning's 2e-5
