"""Issue 19's measurements (``run_h100.sh recipes``): recipe files for each run, the smallest model that
passed its gates, and the table of perplexity, parameters, size and vLLM serving speed.

    python3 tests/gpu/recipes_table.py recipe --ratio 0.5 --loss lm --steps 500 --calibration C --dataset D \\
        --out r.yaml [--quantize]
    python3 tests/gpu/recipes_table.py smallest RUNS          # the smallest acceptable run's model dir
    python3 tests/gpu/recipes_table.py table RUNS --serving S.csv --device NAME --csv T.csv --md T.md

Every recipe is the shipped ``sample:prune-distill-int4`` with the measured knobs changed (pruning ratio,
recovery loss and steps, with or without its int4 stage), calibrated and validated on the given files: the
curve's points differ from the recipe only in what the curve varies. ``RUNS`` holds one ``squeezeserve
pipeline`` output per run (``RUNS/NAME/model/squeeze.json``).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import yaml

from squeezeserve.service.compress.recipes import recipe_path

SOURCE = "sample:prune-distill-int4"
BASELINE = "baseline"


def write_recipe(args: argparse.Namespace) -> None:
    data = yaml.safe_load(recipe_path(SOURCE).read_text())
    prune, distill, quantize = data["stages"]
    if "structure" not in prune or distill.get("method") != "distill":
        raise SystemExit(f"{SOURCE} no longer starts with structured pruning and distillation: update me")
    prune["structure"] = args.structure
    prune["ratio"] = args.ratio
    distill["recover_loss"] = args.loss
    distill["recover_steps"] = args.steps
    if args.lr:
        distill["recover_lr"] = args.lr
    data["stages"] = [prune, distill] + ([quantize] if args.quantize else [])
    data["calibration"] = args.calibration
    quantized = " -> int4" if args.quantize else ""
    data["description"] = f"{args.structure} {args.ratio} -> {args.loss} {args.steps} steps{quantized}"
    validate = data["validate"]
    validate.pop("max_tokens", None)  # the whole test file unless --max-tokens
    if args.max_tokens:
        validate["max_tokens"] = args.max_tokens
    validate.update(dataset=args.dataset, dtype=args.dtype)
    Path(args.out).write_text(yaml.safe_dump(data, sort_keys=False))


def runs(root: Path) -> list[dict]:
    """One row per finished pipeline run under ``root``, from its final squeeze.json."""
    rows = []
    for record_path in sorted(root.glob("*/model/squeeze.json")):
        record = json.loads(record_path.read_text())
        if "validation" not in record:
            continue
        stages = {stage["name"]: stage for stage in record["stages"]}
        structured = stages.get("prune", {}).get("structured", {})
        recovery = stages.get("distill", {}).get("recovery", {})
        metrics = record["validation"]["metrics"]
        recipe = yaml.safe_load(Path(record["recipe"]["path"]).read_text())
        rows.append(
            {
                "run": record_path.parent.parent.name,
                "structure": stages.get("prune", {}).get("options", {}).get("structure"),
                "ratio": stages.get("prune", {}).get("options", {}).get("ratio"),
                "recover_loss": recovery.get("loss"),
                "recover_steps": recovery.get("steps"),
                "recover_seconds": recovery.get("seconds"),
                "int4": "int4" in stages,
                "parameters": structured.get("parameters", {}).get("after"),
                "baseline_parameters": structured.get("parameters", {}).get("before"),
                "size_bytes": record["stages"][-1]["size_bytes"]["after"],
                "baseline_size_bytes": record["stages"][0]["size_bytes"]["before"],
                "ppl_tokens": recipe["validate"].get("max_tokens", "all"),
                "ppl": metrics.get("ppl_candidate"),
                "ppl_baseline": metrics.get("ppl_baseline"),
                "ppl_ratio": metrics.get("ppl_ratio"),
                "passed": record["validation"]["passed"],
                "model": str(record_path.parent),
            }
        )
    return rows


def smallest(args: argparse.Namespace) -> None:
    """Print the model dir of the smallest checkpoint (bytes) that passed its gates; exit 1 if none did."""
    passed = [row for row in runs(Path(args.runs)) if row["passed"]]
    if not passed:
        sys.exit(1)
    print(min(passed, key=lambda row: row["size_bytes"])["model"])


def serving(path: Path | None) -> dict[tuple[str, int], dict]:
    """bench_serving.py rows by (label, concurrency); the last row of a pair wins."""
    if path is None or not path.exists():
        return {}
    with path.open() as fh:
        return {(row["label"], int(row["concurrency"])): row for row in csv.DictReader(fh)}


def table(args: argparse.Namespace) -> None:
    rows = runs(Path(args.runs))
    if not rows:
        sys.exit(f"no finished pipeline run under {args.runs}")
    first = rows[0]
    baseline = {
        "run": BASELINE,
        "parameters": first["baseline_parameters"],
        "size_bytes": first["baseline_size_bytes"],
        "ppl": first["ppl_baseline"],
        "ppl_ratio": 1.0,
    }
    speed = serving(Path(args.serving) if args.serving else None)
    concurrency = (1, 64)
    out = []
    for row in [
        baseline,
        *sorted(
            rows, key=lambda r: (r["int4"], r["structure"] or "", r["ratio"] or 0, r["recover_loss"] or "")
        ),
    ]:
        row = {key: value for key, value in row.items() if key not in ("baseline_parameters", "model")}
        row.pop("baseline_size_bytes", None)
        row.pop("ppl_baseline", None)
        for c in concurrency:
            served = speed.get((row["run"], c), {})
            base = speed.get((BASELINE, c), {})
            row[f"tpot_ms_p50_c{c}"] = _number(served.get("tpot_ms_p50"))
            row[f"output_tok_s_c{c}"] = _number(served.get("output_tok_per_s"))
            throughput, base_throughput = row[f"output_tok_s_c{c}"], _number(base.get("output_tok_per_s"))
            row[f"throughput_vs_baseline_c{c}"] = (
                throughput / base_throughput if throughput and base_throughput else None
            )
        row["device"] = args.device
        out.append(row)
    fields = list(dict.fromkeys(key for row in out for key in row))
    with open(args.csv, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(out)
    lines = [
        f"Device: {args.device}. Perplexity on wikitext-2 test (window 512 / stride 256, fp16; tokens: "
        "the file's first N, or all of it); serving: vLLM, prompt 256 / output 128 tokens.",
        "",
        "| run | recovery | parameters | size MB | ppl tokens | ppl | ppl / baseline | gates | "
        "TPOT ms c=1 | tok/s c=1 | TPOT ms c=64 | tok/s c=64 | tok/s vs baseline c=64 |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in out:
        gate = "-" if row["run"] == BASELINE else ("pass" if row["passed"] else "FAIL")
        cells = [
            row["run"],
            f"{row['recover_loss']} x {row['recover_steps']}" if row.get("recover_loss") else "-",
            _fmt(row["parameters"] and row["parameters"] / 1e6, "{:.1f} M"),
            _fmt(row["size_bytes"] and row["size_bytes"] / 1e6, "{:.0f}"),
            str(row.get("ppl_tokens", "-")),
            _fmt(row["ppl"], "{:.3f}"),
            _fmt(row["ppl_ratio"], "{:.3f}x"),
            gate,
            _fmt(row["tpot_ms_p50_c1"], "{:.2f}"),
            _fmt(row["output_tok_s_c1"], "{:.0f}"),
            _fmt(row["tpot_ms_p50_c64"], "{:.2f}"),
            _fmt(row["output_tok_s_c64"], "{:.0f}"),
            _fmt(row["throughput_vs_baseline_c64"], "{:.2f}x"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    Path(args.md).write_text(text)
    print(text)


def _number(value: str | None) -> float | None:
    return float(value) if value not in (None, "") else None


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    recipe = sub.add_parser("recipe", help="write one run's recipe")
    recipe.add_argument(
        "--structure", choices=("mlp-width", "heads", "layers"), default="mlp-width", help="what is pruned"
    )
    recipe.add_argument("--ratio", type=float, required=True, help="pruning ratio")
    recipe.add_argument("--loss", choices=("kd", "lm"), required=True, help="recovery loss")
    recipe.add_argument("--steps", type=int, required=True, help="recovery steps")
    recipe.add_argument("--lr", type=float, help="recovery learning rate (default: the recipe's)")
    recipe.add_argument("--quantize", action="store_true", help="keep the recipe's int4 stage")
    recipe.add_argument("--calibration", required=True, help="calibration text of every stage")
    recipe.add_argument("--dataset", required=True, help="validation text (scored whole)")
    recipe.add_argument("--max-tokens", type=int, help="score only the first N tokens (default: all)")
    recipe.add_argument("--dtype", default="float16", help="validation dtype (default: %(default)s)")
    recipe.add_argument("--out", required=True, help="recipe file to write")
    recipe.set_defaults(func=write_recipe)
    small = sub.add_parser("smallest", help="the smallest run that passed its gates")
    small.add_argument("runs")
    small.set_defaults(func=smallest)
    tab = sub.add_parser("table", help="CSV and markdown table of every run")
    tab.add_argument("runs")
    tab.add_argument("--serving", help="bench_serving.py CSV (labels: baseline and run names)")
    tab.add_argument("--device", required=True)
    tab.add_argument("--csv", required=True)
    tab.add_argument("--md", required=True)
    tab.set_defaults(func=table)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
