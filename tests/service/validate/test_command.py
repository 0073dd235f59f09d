"""``squeezeserve validate`` end to end: exit codes, report files, gates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from squeezeserve.service.cli import main

TASK = Path(__file__).parent / "data" / "task.jsonl"


def small_run(baseline: Path, candidate: Path, dataset: Path, out: Path) -> list[str]:
    args = ["validate", "--baseline", str(baseline), "--candidate", str(candidate), "--dataset", str(dataset)]
    return args + ["--max-tokens", "96", "--window", "64", "--stride", "32", "--out", str(out)]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--gate", "ppl_ratio<=x"], "NAME OP NUMBER"),
        (["--gate", "perplexity_ratio<=1.1"], "does not measure"),
        (["--gate", "kl_mean<=0.1", "--skip-accuracy"], "does not measure"),
        (["--skip-accuracy", "--skip-latency"], "nothing to validate"),
        (["--stride", "64"], "--stride"),
    ],
)
def test_usage_errors_exit_2(extra, message, baseline_dir, wikitext_file, tmp_path, capsys):
    assert main([*small_run(baseline_dir, baseline_dir, wikitext_file, tmp_path), *extra]) == 2
    assert message in capsys.readouterr().err


def test_unreadable_dataset_and_unreachable_endpoint_exit_2(baseline_dir, tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    assert main(small_run(baseline_dir, baseline_dir, missing, tmp_path)) == 2
    assert "cannot read" in capsys.readouterr().err

    closed = "http://127.0.0.1:9/v1#nothing"  # the discard port: nothing listens there
    args = small_run(baseline_dir, baseline_dir, missing, tmp_path)
    args[args.index("--candidate") + 1] = closed
    assert main(args) == 2
    assert "unreachable" in capsys.readouterr().err


@pytest.mark.slow  # loads two models and starts two workers
def test_passing_gates_exit_0_and_the_report_parses(baseline_dir, int8_dir, wikitext_file, tmp_path, capsys):
    args = small_run(baseline_dir, int8_dir, wikitext_file, tmp_path)
    args += [
        "--task",
        str(TASK),
        "--concurrency",
        "1,2",
        "--requests-per-level",
        "2",
        "--warmup-requests",
        "1",
    ]
    args += ["--prompt-tokens", "8", "--output-tokens", "3", "--slo-ttft-ms", "60000"]
    args += [
        "--gate",
        "ppl_ratio<=1.5",
        "--gate",
        "top1_agreement>=0.5",
        "--gate",
        "weights_bytes_ratio<0.75",
    ]
    args += ["--gate", "error_rate_candidate@c2<=0"]

    assert main(args) == 0

    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and len(report["gates"]) == 4
    metrics = report["metrics"]
    assert metrics["kl_mean"] > 0 and 0.5 < metrics["top1_agreement"] < 1
    assert metrics["ppl_ratio"] == pytest.approx(metrics["ppl_candidate"] / metrics["ppl_baseline"])
    assert 0 <= metrics["task_acc_candidate"] <= 1
    assert metrics["ttft_p50_ms_candidate"] == metrics["ttft_p50_ms_candidate@c1"]
    assert metrics["peak_rss_bytes_baseline"] > 100 * 2**20
    assert [row["concurrency"] for row in report["latency"]["candidate"]] == [1, 2]
    markdown = (tmp_path / "report.md").read_text()
    assert "| perplexity |" in markdown and "`ppl_ratio<=1.5` | " in markdown
    for plot in report["plots"]:
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(report["plots"]) == ["accuracy.png", "latency_vs_concurrency.png"]


@pytest.mark.slow  # loads the model twice
def test_an_impossible_gate_exits_1_and_says_by_how_much(baseline_dir, wikitext_file, tmp_path, capsys):
    args = small_run(baseline_dir, baseline_dir, wikitext_file, tmp_path)
    args += ["--skip-latency", "--gate", "ppl_ratio<0.5", "--gate", "kl_mean<=0"]

    assert main(args) == 1

    gates = json.loads((tmp_path / "report.json").read_text())["gates"]
    assert [(g["gate"], g["passed"]) for g in gates] == [("ppl_ratio<0.5", False), ("kl_mean<=0", True)]
    assert gates[0]["margin"] == pytest.approx(0.5)  # ratio 1.0 against 0.5
    assert "**FAIL**" in (tmp_path / "report.md").read_text()
    assert "FAIL  ppl_ratio<0.5" in capsys.readouterr().out


def test_api_key_file_sends_its_first_key_unless_a_key_is_given(tmp_path, monkeypatch, capsys):
    from squeezeserve.service.cli import build_parser
    from squeezeserve.service.validate.command import config_from_args

    monkeypatch.delenv("SQUEEZESERVE_API_KEY", raising=False)
    keys = tmp_path / "api-keys"
    keys.write_text("k1, k2\n")
    endpoints = ["--baseline", "http://127.0.0.1:9/v1#a", "--candidate", "http://127.0.0.1:9/v1#b"]
    command = ["validate", *endpoints, "--dataset", str(tmp_path / "text.txt")]

    def key(*extra: str) -> str | None:
        return config_from_args(build_parser().parse_args([*command, *extra])).api_key

    assert key("--api-key-file", str(keys)) == "k1"
    assert key("--api-key-file", str(keys), "--api-key", "k9") == "k9"
    assert key("--api-key-file", "/dev/null") is None
    assert main([*command, "--api-key-file", str(tmp_path / "missing")]) == 2
    assert "--api-key-file: cannot read API keys file" in capsys.readouterr().err
