"""tests/gpu/recipes_table.py: the recipes it writes for issue 19's runs are the shipped recipe with the
measured knobs changed, and its table reads what a real pipeline run records."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

from squeezeserve.service.compress import recipes

SCRIPT = Path(__file__).parents[2] / "gpu" / "recipes_table.py"


def run_script(monkeypatch: pytest.MonkeyPatch, *argv: str) -> None:
    spec = importlib.util.spec_from_file_location("recipes_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
    module.main()


def write(monkeypatch, path: Path, *extra: str, ratio="0.5", loss="lm", steps="7") -> recipes.Recipe:
    run_script(monkeypatch, "recipe", "--ratio", ratio, "--loss", loss, "--steps", steps, *extra,
               "--calibration", "sample:wikitext-2-calibration", "--dataset", "sample:wikitext-2-test",
               "--out", str(path))  # fmt: skip
    return recipes.load_recipe(str(path), "teacher-dir")


def test_curve_recipe_changes_only_ratio_loss_and_steps(monkeypatch, tmp_path: Path) -> None:
    shipped = recipes.load_recipe("sample:prune-distill-int4", "teacher-dir")
    curve = write(monkeypatch, tmp_path / "curve.yaml")
    assert [s.name for s in curve.stages] == ["prune", "distill"]
    prune, distill = (s.options.record() for s in curve.stages)
    assert (prune["ratio"], distill["recover_loss"], distill["recover_steps"]) == (0.5, "lm", 7)
    shipped_distill = shipped.stages[1].options.record()
    for key in ("temperature", "recover_lr", "recover_batch_size", "teacher", "calibration_samples"):
        assert distill[key] == shipped_distill[key], key
    argv = curve.validate_argv
    assert argv[argv.index("--dataset") + 1] == "sample:wikitext-2-test"
    assert argv[argv.index("--dtype") + 1] == "float16"
    assert "--max-tokens" not in argv  # the whole test file
    assert argv[argv.index("--gate") + 1] == "ppl_ratio<=1.25"


def test_recipe_with_quantize_keeps_the_int4_stage(monkeypatch, tmp_path: Path) -> None:
    recipe = write(monkeypatch, tmp_path / "r.yaml", "--quantize", ratio="0.25", loss="kd", steps="1000")
    shipped = recipes.load_recipe("sample:prune-distill-int4", "teacher-dir")
    assert recipe.stages[-1].options.record() == shipped.stages[-1].options.record()
    assert [s.options.record() for s in recipe.stages[:2]] == [s.options.record() for s in shipped.stages[:2]]


def test_smallest_refuses_when_no_run_finished(monkeypatch, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        run_script(monkeypatch, "smallest", str(tmp_path))
    assert exc.value.code == 1


@pytest.mark.slow
def test_table_from_a_real_pipeline_run(monkeypatch, capsys, baseline_dir, tmp_path, one_torch_thread):
    path = tmp_path / "tiny.yaml"
    write(monkeypatch, path, ratio="0.75", loss="kd", steps="1")
    data = yaml.safe_load(path.read_text())  # CPU-sized: two short windows, one step, 256 tokens scored
    data.update(calibration_samples=2, calibration_seq_len=64)
    data["stages"][1]["recover_batch_size"] = 1
    data["validate"].update(max_tokens=256, window=128, stride=64, dtype="float32", gates=["ppl_ratio<=100"])
    path.write_text(yaml.safe_dump(data))
    runs = tmp_path / "runs"
    code, record = recipes.run_recipe(str(path), str(baseline_dir), runs / "mlp0.75-kd")
    assert code == 0
    serving = tmp_path / "serving.csv"
    serving.write_text(
        "run,label,concurrency,tpot_ms_p50,output_tok_per_s\n"
        "recipes,baseline,64,4.0,5000\nrecipes,mlp0.75-kd,64,3.0,6500\n"
    )
    run_script(monkeypatch, "smallest", str(runs))
    assert capsys.readouterr().out.strip() == str(runs / "mlp0.75-kd" / "model")
    run_script(monkeypatch, "table", str(runs), "--serving", str(serving), "--device", "cpu",
               "--csv", str(tmp_path / "t.csv"), "--md", str(tmp_path / "t.md"))  # fmt: skip
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert [r["run"] for r in rows] == ["baseline", "mlp0.75-kd"]
    metrics = record["validation"]["metrics"]
    assert float(rows[1]["ppl"]) == pytest.approx(metrics["ppl_candidate"])
    assert float(rows[0]["ppl"]) == pytest.approx(metrics["ppl_baseline"])
    pruned = record["stages"][0]["structured"]["parameters"]
    assert int(rows[1]["parameters"]) == pruned["after"] < int(rows[0]["parameters"]) == pruned["before"]
    assert rows[1]["recover_loss"] == "kd" and rows[1]["passed"] == "True"
    assert float(rows[1]["throughput_vs_baseline_c64"]) == pytest.approx(1.3)
    assert rows[0]["tpot_ms_p50_c1"] == ""  # c=1 is not in the serving CSV
    assert "| mlp0.75-kd |" in (tmp_path / "t.md").read_text()
