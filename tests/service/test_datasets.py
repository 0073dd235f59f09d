"""The texts shipped with the package: named as ``sample:NAME`` wherever a command takes a text file."""

from __future__ import annotations

import pytest

from squeezeserve.service.cli import main
from squeezeserve.service.compress.options import build_options
from squeezeserve.service.datasets import SAMPLES, resolve, sample_path
from squeezeserve.service.validate.data import read_text


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_sample_is_whole_articles_of_utf8_text(name: str) -> None:
    text = sample_path(name).read_text(encoding="utf-8")
    assert 50_000 < len(text.encode()) < 300_000  # enough for the suite and the defaults, small to ship
    assert text.lstrip("\n ").startswith("= ")  # starts at an article heading, as WikiText does


def test_sample_names_resolve_and_paths_pass_through(tmp_path) -> None:
    assert resolve("sample:wikitext-2-test") == str(sample_path("wikitext-2-test"))
    assert resolve(str(tmp_path / "mine.txt")) == str(tmp_path / "mine.txt")
    assert read_text("sample:wikitext-2-test").startswith(" \n = Robert")


def test_calibration_accepts_a_sample_name() -> None:
    options = build_options(method="int4", calibration="sample:wikitext-2-calibration")
    assert options.calibration == str(sample_path("wikitext-2-calibration"))


def test_an_unknown_sample_is_a_usage_error_naming_the_known_ones(tmp_path, capsys) -> None:
    args = ["compress", "--model", str(tmp_path), "--method", "int4", "--out", str(tmp_path / "out")]
    assert main([*args, "--calibration", "sample:nope"]) == 2
    err = capsys.readouterr().err
    assert "sample:nope" in err and "sample:wikitext-2-calibration" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_calibration_sample_holds_the_default_windows(baseline_dir) -> None:
    """``compress --calibration sample:wikitext-2-calibration`` works with the default 128 x 512 windows."""
    from transformers import AutoTokenizer

    from squeezeserve.service.compress.calibration import calibration_batches

    options = build_options(method="int4", calibration="sample:wikitext-2-calibration")
    tokenizer = AutoTokenizer.from_pretrained(baseline_dir)
    batches = calibration_batches(
        options.calibration, tokenizer, options.calibration_samples, options.calibration_seq_len
    )
    assert tuple(batches.input_ids.shape) == (options.calibration_samples, options.calibration_seq_len)
