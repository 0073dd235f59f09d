"""Distillation recovery on a tiny random Llama: a structurally pruned student moves towards its teacher
under kd, its LM loss falls under lm, and pruning masks survive the fine-tune."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from squeezeserve.kernels import reference
from squeezeserve.service.compress.distill import distill, zero_masks
from squeezeserve.service.compress.options import build_options
from squeezeserve.service.compress.structured import prune_mlp_width

STEPS = 25


def teacher_and_student() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(config).eval().requires_grad_(False)
    student = copy.deepcopy(teacher)
    for layer in student.model.layers:
        prune_mlp_width(layer, torch.eye(64), 32)
    return teacher, student


def options(loss: str):
    return build_options(
        method="prune",
        structure="mlp-width",
        ratio=0.5,
        calibration="sample:wikitext-2-calibration",
        recover_steps=STEPS,
        recover_lr=3e-3,
        recover_batch_size=4,
        recover_loss=loss,
    )


def linears(model) -> list[str]:
    return [f"model.layers.{i}.{p}" for i in range(2) for p in ("mlp.up_proj", "mlp.down_proj")]


@torch.no_grad()
def kl_to_teacher(student, teacher, ids) -> float:
    hs = student.model(input_ids=ids).last_hidden_state.flatten(0, 1)
    ht = teacher.model(input_ids=ids).last_hidden_state.flatten(0, 1)
    return float(reference.linear_kd(hs, student.lm_head.weight, ht, teacher.lm_head.weight))


def test_kd_moves_the_pruned_student_towards_the_teacher() -> None:
    teacher, student = teacher_and_student()
    ids = torch.randint(0, 64, (16, 24), generator=torch.Generator().manual_seed(1))
    before = kl_to_teacher(student, teacher, ids)
    losses = distill(student, teacher, dict.fromkeys(linears(student)), ids, options("kd"))
    assert len(losses) == STEPS
    assert kl_to_teacher(student, teacher, ids) < 0.7 * before
    assert student.model.layers[0].mlp.up_proj.weight.requires_grad is False  # frozen again afterwards


def test_lm_recovery_lowers_next_token_loss_and_keeps_masks() -> None:
    _, student = teacher_and_student()
    ids = torch.arange(24).repeat(16, 1) % 64  # a learnable pattern
    down = student.model.layers[0].mlp.down_proj
    with torch.no_grad():
        down.weight[:, ::2] = 0
    trained = zero_masks({name: student.get_submodule(name) for name in linears(student)})
    assert (
        trained["model.layers.0.mlp.down_proj"] is not None and trained["model.layers.1.mlp.up_proj"] is None
    )
    losses = distill(student, None, trained, ids, options("lm"))
    assert losses[-1] < losses[0]
    assert torch.count_nonzero(down.weight[:, ::2]) == 0


def test_kd_is_the_default_recovery_after_structured_pruning() -> None:
    assert options(None).recover_loss == "kd"  # type: ignore[arg-type]
    sparse = build_options(method="prune", sparsity="0.5", prune_method="magnitude", recover_steps=1,
                           calibration="sample:wikitext-2-calibration")  # fmt: skip
    assert sparse.recover_loss == "lm"
    with pytest.raises(ValueError, match="needs --teacher"):
        build_options(method="distill", recover_steps=1, calibration="sample:wikitext-2-calibration")
