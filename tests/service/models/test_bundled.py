"""The bundled baseline export: a plain Hugging Face checkpoint, made once, with clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from squeezeserve.service.models import bundled

pytestmark = pytest.mark.slow


def test_baseline_is_a_plain_checkpoint(baseline_dir: Path) -> None:
    config = json.loads((baseline_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float16"
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", bundled.MARKER):
        assert (baseline_dir / name).is_file(), name


def test_export_is_idempotent_and_says_so(baseline_dir: Path) -> None:
    if not (baseline_dir / bundled.MARKER).is_file():
        pytest.skip("SQUEEZESERVE_TEST_MODEL points at a checkpoint that is not the bundled baseline")
    result = bundled.export_baseline(baseline_dir)
    assert result.path == baseline_dir and not result.created
    out = subprocess.run(
        [sys.executable, "-m", "squeezeserve.service.cli", "model", "baseline", "--out", str(baseline_dir)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "already up to date" in out.stdout


def test_export_refuses_to_overwrite_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(FileExistsError, match="not a squeezeserve baseline"):
        bundled.export_baseline(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "not a checkpoint"


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        bundled.export_baseline(dtype="int3")


def test_export_prints_no_warning(tmp_path: Path) -> None:
    """A first export says what it did and nothing a user cannot act on (no library warnings)."""
    command = [sys.executable, "-m", "squeezeserve.service.cli", "model", "baseline"]
    out = subprocess.run(
        [*command, "--out", str(tmp_path / "baseline"), "--dtype", "bfloat16"],
        capture_output=True,
        text=True,
        check=True,
    )
    # Progress bars (carriage-return frames on stderr) are fine; warnings are not.
    lines = [line for line in (out.stdout + out.stderr).replace("\r", "\n").splitlines() if line.strip()]
    # The export line prints the temporary path, which pytest names after this test: leave it out.
    lines = [line.replace(str(tmp_path), "OUT") for line in lines]
    assert not [line for line in lines if "warn" in line.lower()], lines
    assert "exported baseline (bfloat16)" in out.stdout
