"""Compress the bundled model with every method; measure size on disk, compress time, wikitext-2 perplexity
and top-1 agreement with the baseline. Appends one row per method to ``results/compress.csv``.

Perplexity and agreement come from the validation job's own code (``squeezeserve.service.validate``:
``data.sliding_windows`` and ``accuracy.compare`` with two local scorers), in float32, so the numbers are
the ones ``squeezeserve validate`` reports for the same window and stride.

    # compress times on this machine only (no evaluation):
    python tests/benchmarks/bench_compress.py --work /tmp/bench --no-eval
    # everything, the evaluation on a GPU (the full wikitext-2 test file is ~312k tokens: ~37 min per
    # model on one CPU core, seconds on a GPU):
    python tests/benchmarks/bench_compress.py --work /tmp/bench --device cuda
    # a subset, on a slice:
    python tests/benchmarks/bench_compress.py --work /tmp/bench --runs int8 int4-gptq-g32 --max-tokens 8192
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from squeezeserve.service.compress.options import build_options
from squeezeserve.service.compress.pipeline import compress, versions
from squeezeserve.service.validate import data
from squeezeserve.service.validate.accuracy import LocalScorer, compare
from squeezeserve.service.validate.size import checkpoint_bytes

RESULTS = Path(__file__).parent / "results" / "compress.csv"
WIKITEXT = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "wikitext-2"
CALIBRATED = "calibrated"  # placeholder in RUNS, replaced by the calibration options of the command line

# name -> build_options keyword arguments; the README table's runs first, then the group-size study.
RUNS: dict[str, dict[str, Any]] = {
    "int8": {"method": "int8"},
    "int4-gptq-g32": {"method": "int4", "group_size": 32, CALIBRATED: True},
    "int4-rtn-g32": {"method": "int4", "algorithm": "rtn", "group_size": 32},
    "fp8": {"method": "fp8"},
    "prune-0.5-magnitude": {"method": "prune", "sparsity": "0.5", "prune_method": "magnitude"},
    "prune-0.5-wanda": {"method": "prune", "sparsity": "0.5", CALIBRATED: True},
    "prune-2of4-wanda": {"method": "prune", "sparsity": "2:4", CALIBRATED: True},
    "2of4-wanda+int4-gptq-g32": {"method": "int4", "group_size": 32, "sparsity": "2:4", CALIBRATED: True},
    "int4-gptq-g64": {"method": "int4", "group_size": 64, CALIBRATED: True},
    "int4-rtn-g64": {"method": "int4", "algorithm": "rtn", "group_size": 64},
    "int4-gptq-g32-sym": {"method": "int4", "group_size": 32, "symmetric": True, CALIBRATED: True},
    "int4-rtn-g32-sym": {"method": "int4", "algorithm": "rtn", "group_size": 32, "symmetric": True},
    "int4-gptq-g64-sym": {"method": "int4", "group_size": 64, "symmetric": True, CALIBRATED: True},
    "int4-rtn-g64-sym": {"method": "int4", "algorithm": "rtn", "group_size": 64, "symmetric": True},
    "prune-0.5-wanda+recover": {"method": "prune", "sparsity": "0.5", "recover": True, CALIBRATED: True},
}
COLUMNS = [
    "run", "options", "size_bytes", "baseline_size_bytes", "compress_seconds", "compress_host",
    "compress_threads", "ppl", "baseline_ppl", "ppl_ratio", "top1_agreement", "kl_mean", "eval_tokens",
    "window", "stride", "eval_device", "weights_sha256", "versions", "date",
]  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--baseline", help="baseline checkpoint (default: export the bundled model)")
    parser.add_argument("--work", required=True, help="folder for the compressed checkpoints")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--data", default=str(WIKITEXT), help="folder with test.txt and calibration.txt")
    parser.add_argument("--calibration-samples", type=int, default=32)
    parser.add_argument("--calibration-seq-len", type=int, default=512)
    parser.add_argument("--recover-steps", type=int, default=32)
    parser.add_argument("--no-eval", action="store_true", help="compress and time only")
    parser.add_argument("--reuse", action="store_true", help="evaluate checkpoints already in --work")
    parser.add_argument("--device", default="cpu", help="where to evaluate (compression runs on the CPU)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, help="evaluate on the first N tokens (default: all)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--csv", default=str(RESULTS))
    return parser.parse_args()


def options_for(name: str, args: argparse.Namespace) -> dict[str, Any]:
    options = dict(RUNS[name])
    if options.pop(CALIBRATED, False):
        options["calibration"] = str(Path(args.data) / "calibration.txt")
        options["calibration_samples"] = args.calibration_samples
        options["calibration_seq_len"] = args.calibration_seq_len
    if options.pop("recover", False):
        options["recover_steps"] = args.recover_steps
    return options


def tensors_sha256(path: Path) -> str:
    """Hash of the weight file(s): equal hashes mean two hosts wrote the very same checkpoint."""
    digest = hashlib.sha256()
    for file in sorted(path.glob("*.safetensors")):
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 evaluation means float32 on a GPU too
    if args.baseline:
        baseline = Path(args.baseline)
    else:
        from squeezeserve.service.models.bundled import export_baseline

        baseline = export_baseline().path
    evaluator = None if args.no_eval else Evaluator(baseline, args)
    stamp = {"versions": json.dumps(versions(), sort_keys=True), "date": datetime.date.today().isoformat()}
    for name in args.runs:
        out = Path(args.work) / name
        options = options_for(name, args)
        seconds = None
        if not (args.reuse and (out / "config.json").is_file()):
            start = time.perf_counter()
            compress(str(baseline), out, build_options(**options), overwrite=True)
            seconds = round(time.perf_counter() - start, 1)
        row = {
            "run": name,
            "options": json.dumps(options, sort_keys=True),
            "size_bytes": checkpoint_bytes(out),
            "baseline_size_bytes": checkpoint_bytes(baseline),
            "compress_seconds": seconds,
            "compress_host": platform.node(),
            "compress_threads": torch.get_num_threads(),
            "weights_sha256": tensors_sha256(out),
        }
        if evaluator is not None:
            row |= evaluator.evaluate(out)
        append_row(Path(args.csv), row | stamp)
        print(f"{name}: {json.dumps(row)}", flush=True)  # noqa: T201


def append_row(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.is_file()
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow(row)


class Evaluator:
    """The baseline loaded once; each candidate compared with it over the same windows."""

    def __init__(self, baseline: Path, args: argparse.Namespace) -> None:
        self.device = args.device
        self.reference = LocalScorer.load(baseline, dtype="float32", device=args.device)
        text = data.read_text(str(Path(args.data) / "test.txt"))
        ids = data.tokenize(self.reference.tokenizer, text, args.max_tokens)
        self.windows = data.sliding_windows(ids, args.window, args.stride)
        self.window, self.stride = args.window, args.stride

    def evaluate(self, out: Path) -> dict[str, Any]:
        candidate = LocalScorer.load(out, dtype="float32", device=self.device)
        side_b, side_c, fidelity = compare(self.reference, candidate, self.windows)
        return {
            "ppl": round(side_c.perplexity, 4),
            "baseline_ppl": round(side_b.perplexity, 4),
            "ppl_ratio": round(side_c.perplexity / side_b.perplexity, 4),
            "top1_agreement": round(fidelity.top1_agreement or 0.0, 4),
            "kl_mean": None if fidelity.kl_mean is None else round(fidelity.kl_mean, 5),
            "eval_tokens": side_c.tokens,
            "window": self.window,
            "stride": self.stride,
            "eval_device": torch.cuda.get_device_name() if self.device.startswith("cuda") else "cpu",
        }


if __name__ == "__main__":
    main()
