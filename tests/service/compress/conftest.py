from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Compress and score on one thread: on the shared 2-core CI box, torch's 2-thread pool waits at every
    op for a core another job holds (measured: GPTQ of the bundled model 35 s on 1 thread, 83 s on 2)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_checkpoint(baseline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (2 layers, 64 wide) in float16 with the bundled model's tokenizer, so the shipped
    calibration text tokenizes as it does for the real model."""
    config = LlamaConfig(
        vocab_size=49152,  # the bundled tokenizer's
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(baseline_dir / name, path / name)
    return path
