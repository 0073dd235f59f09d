"""``squeezeserve pipeline RECIPE``: ordered compress stages, then validate against the baseline (see
``recipes.py``). Exit codes as validate's: 0 every gate passes, 1 a gate fails, 2 usage error (a recipe that
cannot run, a bad option) or a run that could not finish."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "recipe", help="recipe YAML file, or sample:NAME for one that ships (sample:prune-distill-int4)"
    )
    parser.add_argument("--model", required=True, help="the baseline: dense checkpoint directory or id")
    parser.add_argument(
        "--out", required=True, help="run directory: stages/, model/ (final checkpoint), report/"
    )
    parser.add_argument("--device", default="cpu", help="where to compress and validate: cpu or cuda[:N]")
    parser.add_argument("--threads", type=int, help="torch CPU threads (1 is fastest on a busy machine)")


def run(args: argparse.Namespace) -> int:
    from squeezeserve.service.compress.command import set_threads
    from squeezeserve.service.compress.recipes import RecipeError, run_recipe
    from squeezeserve.service.validate.specs import UsageError

    if not set_threads(args.threads):
        return 2
    try:
        code, record = run_recipe(args.recipe, args.model, args.out, device=args.device)
    except (RecipeError, UsageError, FileNotFoundError, MemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as exc:
        print(f"error: the pipeline could not finish: {exc}", file=sys.stderr)
        return 2
    for stage in record["stages"]:
        how = "reused" if stage["resumed"] else f"{stage['wall_seconds']:.1f} s"
        print(f"stage {stage['name']}: {stage['checkpoint']} ({how})")
    print(f"model: {args.out}/model  report: {record['validation']['report']}/report.md")
    for gate in record["validation"]["gates"]:
        value = "not measured" if gate["value"] is None else f"{gate['value']:.6g}"
        print(f"  {'pass' if gate['passed'] else 'FAIL'}  {gate['gate']}  (value {value})")
    return code
