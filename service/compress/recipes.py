"""Compression recipes: ordered ``compress`` stages, then ``validate`` against the original baseline.

A recipe is a YAML file (examples ship in ``recipes/``, e.g. ``sample:prune-distill-int4``)::

    calibration: sample:wikitext-2-calibration   # defaults for every stage (any compress option)
    calibration_samples: 128
    stages:                                      # each: a name and compress options (underscores)
      - {name: prune, method: prune, structure: mlp-width, ratio: 0.25}
      - {name: distill, method: distill, recover_steps: 500, temperature: 2.0}
      - {name: int4, method: int4}
    validate:                                    # validate's flags (underscores); baseline and
      dataset: sample:wikitext-2-test            # candidate are filled in
      max_tokens: 4096
      skip_latency: true
      gates: ["ppl_ratio<=1.25", "top1_agreement>=0.7"]

Stage ``i`` compresses stage ``i - 1``'s output (the first: the baseline); a ``distill`` stage's teacher
defaults to the baseline. Everything is checked before any work (each stage's options through
``build_options``, the validate section through validate's own parser). Layout of ``--out``::

    stages/01-prune/ ...   each stage's checkpoint, with the squeeze.json its compress run wrote
    model/                 the final checkpoint; its squeeze.json records the recipe, every stage's
                           options, timings and sizes, and the validation verdict
    report/                the validation report (report.md, report.json, plots)

**Resume.** ``compress`` writes each stage atomically (a stage directory exists only once complete), and a
stage whose directory holds a squeeze.json with the same options (and source) as the recipe's is reused,
so a run interrupted in stage ``k`` restarts at stage ``k``. The first stage that has to run again makes
every later one run again too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from squeezeserve.service.compress.options import CompressOptions, build_options
from squeezeserve.service.paths import atomic_directory

log = logging.getLogger(__name__)

RECIPE_DIR = Path(__file__).parent / "recipes"
RECIPE_PREFIX = "sample:"
TOP_LEVEL = {"description", "stages", "validate"}
RECORD = "squeeze.json"


class RecipeError(ValueError):
    """A recipe that cannot run, with a sentence saying why (exit code 2)."""


@dataclass(frozen=True)
class Stage:
    index: int
    name: str
    options: CompressOptions

    @property
    def directory(self) -> str:
        return f"{self.index:02d}-{self.name}"


@dataclass(frozen=True)
class Recipe:
    path: Path
    sha256: str
    stages: list[Stage]
    validate_argv: list[str]  # validate's flags, without --baseline/--candidate/--out


def recipe_path(name: str) -> Path:
    """A recipe file, or ``sample:NAME`` for one shipped in ``recipes/``."""
    if name.startswith(RECIPE_PREFIX):
        path = RECIPE_DIR / f"{name[len(RECIPE_PREFIX) :]}.yaml"
        if not path.is_file():
            known = ", ".join(RECIPE_PREFIX + p.stem for p in sorted(RECIPE_DIR.glob("*.yaml")))
            raise RecipeError(f"unknown recipe {name}; the package ships {known}")
        return path
    path = Path(name).expanduser()
    if not path.is_file():
        raise RecipeError(f"recipe {path} does not exist")
    return path


def load_recipe(name: str, baseline: str) -> Recipe:
    """Read and check a recipe; ``baseline`` is the default teacher of distill stages."""
    path = recipe_path(name)
    raw = path.read_bytes()
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("stages"), list) or not data["stages"]:
        raise RecipeError(f"{path}: a recipe is a mapping with a non-empty list of stages")
    defaults = {key: value for key, value in data.items() if key not in TOP_LEVEL}
    stages, names = [], set()
    for index, spec in enumerate(data["stages"], start=1):
        if not isinstance(spec, dict) or "method" not in spec:
            raise RecipeError(f"{path}: stage {index} must be a mapping with at least a method")
        spec = dict(spec)
        name = str(spec.pop("name", spec["method"]))
        if name in names or not name.replace("-", "").replace("_", "").isalnum():
            raise RecipeError(f"{path}: stage {index} needs a unique name of letters, digits, - and _")
        names.add(name)
        kwargs = defaults | spec
        if kwargs["method"] == "distill":
            kwargs.setdefault("teacher", baseline)
        try:
            options = build_options(**kwargs)
        except (TypeError, ValueError) as exc:  # TypeError: an option compress does not have
            raise RecipeError(f"{path}: stage {index} ({name}): {exc}") from exc
        stages.append(Stage(index, name, options))
    for stage in stages[:-1]:
        if stage.options.method in ("int8", "int4", "fp8", "lowrank", "codebook"):
            # Its output is no plain checkpoint: compress (and so every later stage) refuses it as a source.
            raise RecipeError(f"{path}: stage {stage.name} quantizes or factors; only the last stage may")
    return Recipe(path, hashlib.sha256(raw).hexdigest(), stages, validate_flags(data.get("validate"), path))


def validate_flags(section: Any, path: Path) -> list[str]:
    """The recipe's validate section as validate's command-line flags."""
    if section is None:
        raise RecipeError(f"{path}: a recipe needs a validate section (at least a dataset)")
    if not isinstance(section, dict):
        raise RecipeError(f"{path}: validate must be a mapping of validate's options")
    argv: list[str] = []
    for key, value in section.items():
        flag = "--" + str(key).replace("_", "-")
        if key in ("baseline", "candidate", "out"):
            raise RecipeError(f"{path}: validate.{key} is set by the pipeline")
        if key in ("gates", "gate"):
            for gate in value if isinstance(value, list) else [value]:
                argv += ["--gate", str(gate)]
        elif isinstance(value, bool):
            argv += [flag] if value else []
        elif isinstance(value, list):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def validate_config(recipe: Recipe, baseline: str, candidate: Path, report: Path, device: str) -> Any:
    """validate's JobConfig for the final checkpoint, through validate's own parser and checks."""
    from squeezeserve.service.validate import command as validate_command

    parser = argparse.ArgumentParser(prog="squeezeserve pipeline: validate", exit_on_error=False)
    validate_command.add_arguments(parser)
    argv = [
        "--baseline",
        baseline,
        "--candidate",
        str(candidate),
        "--out",
        str(report),
        *recipe.validate_argv,
    ]
    if "--device" not in argv:
        argv += ["--device", device]
    try:
        args = parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise RecipeError(f"{recipe.path}: validate: {exc}") from None
    return validate_command.config_from_args(args)


def _reusable(stage_dir: Path, source: Path, options: CompressOptions) -> dict[str, Any] | None:
    """The stage's compress record when ``stage_dir`` is a finished run of these options on ``source``."""
    record_path = stage_dir / RECORD
    if not record_path.is_file():
        return None
    record = json.loads(record_path.read_text())
    if record.get("options") != options.record() or record.get("source") != str(source):
        return None
    return record


def run_stages(
    recipe: Recipe, baseline: Path, out: Path, device: str, compress: Any = None
) -> tuple[Path, list[dict[str, Any]]]:
    """Run (or reuse) every stage; returns the last stage's checkpoint and one summary per stage.
    ``compress``: the compress function (``pipeline.compress`` unless given)."""
    if compress is None:
        from squeezeserve.service.compress.pipeline import compress
    source, summaries, reuse = baseline, [], True
    for stage in recipe.stages:
        stage_dir = out / "stages" / stage.directory
        record = _reusable(stage_dir, source, stage.options) if reuse else None
        resumed = record is not None
        if record is None:
            reuse = False
            log.info("stage %d/%d: %s", stage.index, len(recipe.stages), stage.name)
            record = compress(str(source), stage_dir, stage.options, overwrite=True, device=device).record
        else:
            log.info("stage %d/%d: %s reused from %s", stage.index, len(recipe.stages), stage.name, stage_dir)
        summaries.append(
            {
                "name": stage.name,
                "options": stage.options.record(),
                "checkpoint": str(stage_dir),
                "resumed": resumed,
                "wall_seconds": record["wall_seconds"],
                "size_bytes": record["size_bytes"],
                **{key: record[key] for key in ("structured", "recovery") if key in record},
            }
        )
        source = stage_dir
    return source, summaries


def publish(last_stage: Path, out: Path, record: dict[str, Any]) -> Path:
    """Copy (hard-link where possible) the last stage's checkpoint to ``out/model`` with ``record`` as its
    squeeze.json, atomically."""
    final = out / "model"
    with atomic_directory(final) as tmp:
        for item in last_stage.iterdir():
            if item.name == RECORD or not item.is_file():
                continue
            try:
                os.link(item, tmp / item.name)
            except OSError:
                shutil.copy2(item, tmp / item.name)
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return final


def run_recipe(
    name: str, baseline: str, out: str | Path, device: str = "cpu", compress: Any = None
) -> tuple[int, dict[str, Any]]:
    """Run a recipe end to end; returns validate's exit code (0 pass, 1 a gate failed) and the record.
    Raises ``RecipeError`` (exit 2) before any work when the recipe cannot run."""
    from squeezeserve.service.compress.pipeline import resolve_source, versions
    from squeezeserve.service.validate.job import Job

    start = time.perf_counter()
    out = Path(out).expanduser().resolve()  # stage records name their source by absolute path
    try:
        source = resolve_source(baseline)
    except FileNotFoundError as exc:
        raise RecipeError(str(exc)) from exc
    recipe = load_recipe(name, str(source))
    # Checked before any work, the baseline standing in for the candidate that does not exist yet.
    validate_config(recipe, str(source), source, out / "report", device)
    last, stages = run_stages(recipe, source, out, device, compress)
    record = {
        "recipe": {"path": str(recipe.path), "sha256": recipe.sha256},
        "baseline": str(source),
        "stages": stages,
        "versions": versions(),
    }
    final = publish(last, out, record)
    validation_start = time.perf_counter()
    report = Job(validate_config(recipe, str(source), final, out / "report", device)).run()
    record["validation"] = {
        "report": str(out / "report"),
        "passed": report["passed"],
        "gates": report["gates"],
        "metrics": report["metrics"],
        "wall_seconds": round(time.perf_counter() - validation_start, 2),
    }
    record["wall_seconds"] = round(time.perf_counter() - start, 2)
    (final / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return (0 if report["passed"] else 1), record
