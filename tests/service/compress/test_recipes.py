"""``squeezeserve pipeline``: a tiny recipe end to end on the bundled model (structured prune -> distill ->
int8 -> validate), resumed after an interruption in its second stage; gates decide the exit code; recipes
that cannot run are refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from squeezeserve.service.cli import main
from squeezeserve.service.compress import recipes
from squeezeserve.service.compress.pipeline import compress
from squeezeserve.service.models.loader import load_model

TINY = {
    "calibration": "sample:wikitext-2-calibration",
    "calibration_samples": 2,
    "calibration_seq_len": 64,
    "stages": [
        {"name": "prune", "method": "prune", "structure": "layers", "ratio": 0.1},
        {"name": "distill", "method": "distill", "recover_steps": 1, "recover_batch_size": 1},
        {"name": "int8", "method": "int8"},
    ],
    "validate": {
        "dataset": "sample:wikitext-2-test",
        "max_tokens": 256,
        "window": 128,
        "stride": 64,
        "skip_latency": True,
        "gates": ["ppl_ratio<=3"],
    },
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.slow
def test_recipe_runs_resumes_after_an_interruption_and_gates_the_exit_code(
    baseline_dir: Path, tmp_path: Path
) -> None:
    recipe = write_recipe(tmp_path / "tiny.yaml", TINY)
    out = tmp_path / "run"

    def interrupted(source, stage_dir, options, **kwargs):
        if Path(stage_dir).name.endswith("distill"):
            raise KeyboardInterrupt  # e.g. Ctrl-C while the second stage runs
        return compress(source, stage_dir, options, **kwargs)

    with pytest.raises(KeyboardInterrupt):
        recipes.run_recipe(str(recipe), str(baseline_dir), out, compress=interrupted)
    assert sorted(p.name for p in (out / "stages").iterdir()) == ["01-prune"]
    assert not (out / "model").exists()
    pruned_at = (out / "stages/01-prune/squeeze.json").stat().st_mtime_ns

    assert main(["pipeline", str(recipe), "--model", str(baseline_dir), "--out", str(out)]) == 0
    assert (out / "stages/01-prune/squeeze.json").stat().st_mtime_ns == pruned_at  # reused, not redone
    record = json.loads((out / "model/squeeze.json").read_text())
    assert [s["name"] for s in record["stages"]] == ["prune", "distill", "int8"]
    assert [s["resumed"] for s in record["stages"]] == [True, False, False]
    assert record["stages"][0]["options"]["structure"] == "layers"
    assert record["stages"][0]["structured"]["config"] == {"num_hidden_layers": 27}
    assert record["stages"][1]["recovery"]["loss"] == "kd"
    assert record["stages"][1]["options"]["teacher"] == str(baseline_dir)
    assert all(s["wall_seconds"] > 0 for s in record["stages"])
    assert record["validation"]["passed"] and (out / "report/report.md").is_file()
    config = json.loads((out / "model/config.json").read_text())
    assert config["num_hidden_layers"] == 27 and "quantization_config" in config
    loaded = load_model(out / "model", dtype="float32")
    assert len(loaded.model.model.layers) == 27

    # Only the gates changed: every stage is reused, the stricter gate fails, exit code 1.
    strict = write_recipe(
        tmp_path / "strict.yaml", TINY | {"validate": TINY["validate"] | {"gates": ["ppl_ratio<=1"]}}
    )
    assert main(["pipeline", str(strict), "--model", str(baseline_dir), "--out", str(out)]) == 1
    record = json.loads((out / "model/squeeze.json").read_text())
    assert all(s["resumed"] for s in record["stages"]) and not record["validation"]["passed"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"stages": [{"method": "int4"}, {"method": "prune", "structure": "layers", "ratio": 0.1}]},
            "only the last",
        ),
        ({"stages": [{"method": "prune", "structure": "rows", "ratio": 0.1}]}, "unknown --structure"),
        ({"stages": [{"method": "int8", "nbits": 3}]}, "unexpected keyword argument 'nbits'"),
        ({"stages": [{"method": "int8", "bits": 3}]}, "--bits applies to --method codebook"),
        (
            {"stages": [{"method": "lowrank", "rank_ratio": 0.9}, {"method": "distill", "recover_steps": 1}]},
            "only the last",
        ),
        ({"validate": {"dataset": "sample:wikitext-2-test", "gates": ["nonsense"]}}, "NAME OP NUMBER"),
        ({"validate": None}, "needs a validate section"),
    ],
)
def test_a_recipe_that_cannot_run_exits_2_before_any_work(
    baseline_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, change: dict, message: str
) -> None:
    recipe = write_recipe(tmp_path / "bad.yaml", {k: v for k, v in (TINY | change).items() if v is not None})
    out = tmp_path / "run"
    assert main(["pipeline", str(recipe), "--model", str(baseline_dir), "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_shipped_recipes_load(baseline_dir: Path) -> None:
    names = sorted(p.stem for p in recipes.RECIPE_DIR.glob("*.yaml"))
    assert "prune-distill-int4" in names
    for name in names:
        recipe = recipes.load_recipe(f"sample:{name}", str(baseline_dir))
        assert recipe.stages and "--dataset" in recipe.validate_argv
    issue = recipes.load_recipe("sample:prune-distill-int4", str(baseline_dir))
    assert [s.options.method for s in issue.stages] == ["prune", "distill", "int4"]
    assert issue.stages[1].options.recover_loss == "kd" and issue.stages[1].options.recover_steps == 1000
    (shared,) = recipes.load_recipe("sample:codebook4-kd", str(baseline_dir)).stages
    assert shared.options.recovers_format and shared.options.recover_loss == "kd"
