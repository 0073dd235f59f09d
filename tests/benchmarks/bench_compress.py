"""Compress the bundled model with every method; measure size on disk, compress time, wikitext-2 perplexity
and top-1 agreement with the baseline. Appends one row per method to ``results/compress.csv``.

Perplexity, KL and top-1 agreement follow the validation job's definitions (``validate.data.sliding_windows``
and ``validate.accuracy.compare``: window 512, stride 256, float32), computed here with the windows batched
and the baseline's hidden states kept from its one pass (``compare`` runs one window at a time, both models,
for every candidate); ``--check-against-compare`` asserts the two agree on the slice evaluated.

    # compress times on this machine only (no evaluation), one thread:
    python tests/benchmarks/bench_compress.py --work /tmp/bench --no-eval --threads 1
    # the README's accuracy columns: compress on the GPU and evaluate on the FULL test file (~312k tokens;
    # ~37 min per model on one CPU core, seconds on a GPU):
    python tests/benchmarks/bench_compress.py --work /tmp/bench --device cuda
    # a subset, on a slice, on this CPU:
    python tests/benchmarks/bench_compress.py --work /tmp/bench --runs int8 int4-gptq-g32 --max-tokens 8192
    # low-rank and codebooks against int4 GPTQ g32 (issue 20), full test file, on a GPU:
    python tests/benchmarks/bench_compress.py --work /tmp/bench --device cuda --runs int4-gptq-g32 \
        lowrank-svd-0.9 lowrank-asvd-0.9 lowrank-svdllm-0.9 lowrank-svd-0.8 lowrank-asvd-0.8 \
        lowrank-svdllm-0.8 lowrank-svd-0.7 lowrank-asvd-0.7 lowrank-svdllm-0.7 \
        codebook4-gptq codebook4-kmeans codebook3-gptq
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import json
import math
import platform
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F  # noqa: N812

from squeezeserve.service.compress.options import build_options
from squeezeserve.service.compress.pipeline import compress, versions
from squeezeserve.service.models.loader import load_model
from squeezeserve.service.models.size import checkpoint_bytes
from squeezeserve.service.validate import data
from squeezeserve.service.validate.accuracy import KL_CHUNK, LocalScorer, compare

RESULTS = Path(__file__).parent / "results" / "compress.csv"
WIKITEXT = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "wikitext-2"
CALIBRATED = "calibrated"  # placeholder in RUNS, replaced by the calibration options of the command line

# name -> build_options keyword arguments; the README table's runs first, then the int4 studies (what
# actorder and the scale search each add; group size; symmetric), then recovery.
RUNS: dict[str, dict[str, Any]] = {
    "int8": {"method": "int8"},
    "int8-gptq": {"method": "int8", "algorithm": "gptq", CALIBRATED: True},  # per channel: int8's kernel
    "int4-gptq-g32": {"method": "int4", "group_size": 32, CALIBRATED: True},
    "int4-rtn-g32": {"method": "int4", "algorithm": "rtn", "group_size": 32},
    "fp8": {"method": "fp8"},
    "prune-0.5-magnitude": {"method": "prune", "sparsity": "0.5", "prune_method": "magnitude"},
    "prune-0.5-wanda": {"method": "prune", "sparsity": "0.5", CALIBRATED: True},
    "prune-2of4-wanda": {"method": "prune", "sparsity": "2:4", CALIBRATED: True},
    "2of4-wanda+int4-gptq-g32": {"method": "int4", "group_size": 32, "sparsity": "2:4", CALIBRATED: True},
    "int4-gptq-g32-minmax": {  # GPTQ as it was before actorder and the scale search
        "method": "int4",
        "group_size": 32,
        "actorder": False,
        "scale_search": False,
        CALIBRATED: True,
    },
    "int4-gptq-g32-no-actorder": {"method": "int4", "group_size": 32, "actorder": False, CALIBRATED: True},
    "int4-gptq-g32-no-search": {"method": "int4", "group_size": 32, "scale_search": False, CALIBRATED: True},
    "int4-gptq-g64": {"method": "int4", "group_size": 64, CALIBRATED: True},
    "int4-rtn-g64": {"method": "int4", "algorithm": "rtn", "group_size": 64},
    "int4-gptq-g32-sym": {"method": "int4", "group_size": 32, "symmetric": True, CALIBRATED: True},
    "int4-rtn-g32-sym": {"method": "int4", "algorithm": "rtn", "group_size": 32, "symmetric": True},
    "int4-gptq-g64-sym": {"method": "int4", "group_size": 64, "symmetric": True, CALIBRATED: True},
    "int4-rtn-g64-sym": {"method": "int4", "algorithm": "rtn", "group_size": 64, "symmetric": True},
    # Low-rank (issue 20): plain, activation-scaled (ASVD) and whitened (SVD-LLM) SVD at three budgets;
    # weight sharing at 4 and 3 bits (GPTQ onto the codebooks, and plain Hessian-weighted k-means), against
    # int4-gptq-g32 above.
    **{
        f"lowrank-{algorithm}-{ratio}": {
            "method": "lowrank",
            "algorithm": algorithm,
            "rank_ratio": ratio,
            **({CALIBRATED: True} if algorithm != "svd" else {}),
        }
        for ratio in (0.9, 0.8, 0.7)
        for algorithm in ("svd", "asvd", "svdllm")
    },
    "codebook4-gptq": {"method": "codebook", "bits": 4, CALIBRATED: True},
    "codebook4-kmeans": {"method": "codebook", "bits": 4, "algorithm": "kmeans", CALIBRATED: True},
    "codebook3-gptq": {"method": "codebook", "bits": 3, CALIBRATED: True},
    # Recovery after factoring / weight sharing (format_recovery.py: the factors or the codebook values
    # train, kd from the baseline), on 256 x 512 calibration tokens, with the same formats' and int4's runs
    # without recovery on those tokens beside them (GPTQ's calibration set is the recovery's).
    "codebook4-gptq+recover": {
        "method": "codebook",
        "bits": 4,
        "recover": True,
        CALIBRATED: True,
        "calibration_samples": 256,
    },
    "codebook4-gptq-c256": {"method": "codebook", "bits": 4, CALIBRATED: True, "calibration_samples": 256},
    "int4-gptq-g32-c256": {"method": "int4", "group_size": 32, CALIBRATED: True, "calibration_samples": 256},
    "lowrank-svdllm-0.9+recover": {
        "method": "lowrank",
        "algorithm": "svdllm",
        "rank_ratio": 0.9,
        "recover": True,
        CALIBRATED: True,
        "calibration_samples": 256,
    },
    "lowrank-svdllm-0.9-c256": {
        "method": "lowrank",
        "algorithm": "svdllm",
        "rank_ratio": 0.9,
        CALIBRATED: True,
        "calibration_samples": 256,
    },
    # Recovery fine-tunes (before: the same run without +recover) on 256 x 512 calibration tokens (the file
    # holds ~160k tokens), so --recover-steps 128 at 4 windows a step sees each window twice, not 16 times.
    "prune-0.5-wanda+recover": {
        "method": "prune",
        "sparsity": "0.5",
        "recover": True,
        CALIBRATED: True,
        "calibration_samples": 256,
    },
    "prune-2of4-wanda+recover": {
        "method": "prune",
        "sparsity": "2:4",
        "recover": True,
        CALIBRATED: True,
        "calibration_samples": 256,
    },
}
COLUMNS = [
    "run", "options", "size_bytes", "baseline_size_bytes", "compress_seconds", "compress_host",
    "compress_threads", "compress_device", "ppl", "baseline_ppl", "ppl_ratio", "top1_agreement", "kl_mean",
    "eval_tokens", "window", "stride", "eval_device", "weights_sha256", "versions", "date",
]  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--baseline", help="baseline checkpoint (default: export the bundled model)")
    parser.add_argument("--work", required=True, help="folder for the compressed checkpoints")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--data", default=str(WIKITEXT), help="folder with test.txt and calibration.txt")
    parser.add_argument("--calibration-samples", type=int, default=32)
    parser.add_argument("--calibration-seq-len", type=int, default=512)
    parser.add_argument("--recover-steps", type=int, default=128)
    parser.add_argument("--recover-lr", type=float, help="default: compress's for the run's method")
    parser.add_argument("--no-eval", action="store_true", help="compress and time only")
    parser.add_argument("--reuse", action="store_true", help="evaluate checkpoints already in --work")
    parser.add_argument("--device", default="cpu", help="where to compress and evaluate (cpu, cuda)")
    parser.add_argument("--compress-device", help="where to compress, when not --device")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="tokens per evaluation batch")
    parser.add_argument(
        "--check-against-compare",
        action="store_true",
        help="first check the batched evaluation against validate's compare (slow: use with --max-tokens)",
    )
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, help="evaluate on the first N tokens (default: all)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--csv", default=str(RESULTS))
    return parser.parse_args()


def options_for(name: str, args: argparse.Namespace) -> dict[str, Any]:
    options = dict(RUNS[name])
    if options.pop(CALIBRATED, False):
        options.setdefault("calibration_samples", args.calibration_samples)
        options["calibration"] = str(Path(args.data) / "calibration.txt")
        options["calibration_seq_len"] = args.calibration_seq_len
    if options.pop("recover", False):
        options["recover_steps"] = args.recover_steps
        if args.recover_lr is not None:
            options["recover_lr"] = args.recover_lr
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
    torch.backends.cudnn.allow_tf32 = False
    compress_device = args.compress_device or args.device
    if args.baseline:
        baseline = Path(args.baseline)
    else:
        from squeezeserve.service.models.bundled import export_baseline

        baseline = export_baseline().path
    evaluator = None if args.no_eval else Evaluator(baseline, args)
    if evaluator is not None and args.check_against_compare:
        evaluator.check_against_compare(baseline)
    stamp = {"versions": json.dumps(versions(), sort_keys=True), "date": datetime.date.today().isoformat()}
    failed = []
    for name in args.runs:
        try:
            run(name, args, baseline, compress_device, evaluator, stamp)
        except Exception:  # one broken run must not cost the rows of the others (one device call for all)
            traceback.print_exc()
            failed.append(name)
    if failed:
        raise SystemExit(f"failed runs: {', '.join(failed)}")


def run(
    name: str,
    args: argparse.Namespace,
    baseline: Path,
    compress_device: str,
    evaluator: Evaluator | None,
    stamp: dict[str, str],
) -> None:
    """Compress (unless reusing), evaluate, append the row."""
    out = Path(args.work) / name
    options = options_for(name, args)
    seconds = None
    if not (args.reuse and (out / "config.json").is_file()):
        start = time.perf_counter()
        compress(str(baseline), out, build_options(**options), overwrite=True, device=compress_device)
        if compress_device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = round(time.perf_counter() - start, 1)
    row = {
        "run": name,
        "options": json.dumps(options, sort_keys=True),
        "size_bytes": checkpoint_bytes(out),
        "baseline_size_bytes": checkpoint_bytes(baseline),
        "compress_seconds": seconds,
        "compress_host": platform.node(),
        "compress_threads": torch.get_num_threads(),
        "compress_device": device_name(compress_device),
        "weights_sha256": tensors_sha256(out),
    }
    if evaluator is not None:
        row |= evaluator.evaluate(out)
    append_row(Path(args.csv), row | stamp)
    print(f"{name}: {json.dumps(row)}", flush=True)  # noqa: T201


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"


def append_row(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.is_file()
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow(row)


def load_scorer(path: Path, device: str) -> LocalScorer:
    """float32, plain PyTorch modules, quantized weights expanded once: the numbers measure the compression,
    not our kernels (which have their own tests against the same reference)."""
    loaded = load_model(
        path, dtype="float32", device=device, use_custom_ops=False, quantized_linear="dequantize"
    )
    return LocalScorer(loaded.model, loaded.tokenizer)


@dataclass
class Batch:
    """Windows of one length, stacked: ``ids`` [windows, length]; ``rows`` picks, from the flattened
    [windows * length] hidden states, the positions that predict ``targets`` (each window's last
    ``scored`` tokens)."""

    ids: torch.Tensor
    rows: torch.Tensor
    targets: torch.Tensor


def batches(windows: list[data.Window], tokens_per_batch: int, device: str) -> list[Batch]:
    found: list[Batch] = []
    start = 0
    while start < len(windows):
        length = len(windows[start].ids)
        stop = start
        while (
            stop < len(windows)
            and len(windows[stop].ids) == length
            and (stop - start + 1) * length <= max(tokens_per_batch, length)
        ):
            stop += 1
        rows, targets = [], []
        for i, window in enumerate(windows[start:stop]):
            rows.append(torch.arange(length - window.scored - 1, length - 1) + i * length)
            targets += window.ids[length - window.scored :]
        found.append(
            Batch(
                torch.tensor([w.ids for w in windows[start:stop]], device=device),
                torch.cat(rows).to(device),
                torch.tensor(targets, device=device),
            )
        )
        start = stop
    return found


class Evaluator:
    """The baseline run once over the windows (its scored hidden states kept); each candidate then runs over
    the same batches, and perplexity, KL(baseline || candidate) and top-1 agreement come from the two."""

    def __init__(self, baseline: Path, args: argparse.Namespace) -> None:
        self.device = args.device
        self.chunk = 4096 if args.device.startswith("cuda") else KL_CHUNK  # logits rows at a time
        self.reference = load_scorer(baseline, args.device)
        text = data.read_text(str(Path(args.data) / "test.txt"))
        ids = data.tokenize(self.reference.tokenizer, text, args.max_tokens)
        self.windows = data.sliding_windows(ids, args.window, args.stride)
        self.window, self.stride = args.window, args.stride
        self.batches = batches(self.windows, args.batch_tokens, args.device)
        self.reference_rows = [self.scored_hidden(self.reference, batch) for batch in self.batches]
        self.reference_nll = sum(
            self.nll_sum(self.reference, rows, batch.targets)
            for rows, batch in zip(self.reference_rows, self.batches, strict=True)
        )
        self.tokens = sum(int(batch.targets.numel()) for batch in self.batches)

    @torch.no_grad()
    def scored_hidden(self, scorer: LocalScorer, batch: Batch) -> torch.Tensor:
        hidden = scorer.model.base_model(input_ids=batch.ids, use_cache=False).last_hidden_state
        return hidden.reshape(-1, hidden.shape[-1])[batch.rows]

    @torch.no_grad()
    def nll_sum(self, scorer: LocalScorer, rows: torch.Tensor, targets: torch.Tensor) -> float:
        total = torch.zeros((), dtype=torch.float64, device=rows.device)
        for start in range(0, rows.shape[0], self.chunk):
            logits = scorer.logits(rows[start : start + self.chunk]).float()
            total += F.cross_entropy(logits, targets[start : start + self.chunk], reduction="sum").double()
        return float(total)

    @torch.no_grad()
    def evaluate(self, out: Path) -> dict[str, Any]:
        candidate = load_scorer(out, self.device)
        nll = 0.0
        kl_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        agree = 0
        for rows_b, batch in zip(self.reference_rows, self.batches, strict=True):
            rows_c = self.scored_hidden(candidate, batch)
            nll += self.nll_sum(candidate, rows_c, batch.targets)
            for start in range(0, rows_c.shape[0], self.chunk):
                part = slice(start, start + self.chunk)
                log_p = self.reference.logits(rows_b[part]).float().log_softmax(-1)
                log_q = candidate.logits(rows_c[part]).float().log_softmax(-1)
                kl_sum += (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0).double().sum()
                agree += int((log_p.argmax(-1) == log_q.argmax(-1)).sum())
        ppl, baseline_ppl = math.exp(nll / self.tokens), math.exp(self.reference_nll / self.tokens)
        return {
            "ppl": round(ppl, 4),
            "baseline_ppl": round(baseline_ppl, 4),
            "ppl_ratio": round(ppl / baseline_ppl, 4),
            "top1_agreement": round(agree / self.tokens, 4),
            "kl_mean": round(float(kl_sum) / self.tokens, 5),
            "eval_tokens": self.tokens,
            "window": self.window,
            "stride": self.stride,
            "eval_device": device_name(self.device),
        }

    def check_against_compare(self, baseline: Path) -> None:
        """The batched figures equal the validation job's ``compare`` (one window at a time) on this slice,
        the baseline against itself: perplexity to 1e-4 relative (float32 sums in another order)."""
        side_b, _, _ = compare(self.reference, self.reference, self.windows)
        mine = math.exp(self.reference_nll / self.tokens)
        if side_b.tokens != self.tokens or abs(mine / side_b.perplexity - 1) > 1e-4:
            raise RuntimeError(f"batched perplexity {mine} over {self.tokens} tokens != compare's {side_b}")
        print(f"batched evaluation agrees with compare: {mine:.4f} vs {side_b.perplexity:.4f}")  # noqa: T201


if __name__ == "__main__":
    main()
