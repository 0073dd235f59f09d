"""Low-rank on a CPU-sized slice: each algorithm x calibration size x parameter budget applied to the bundled
model in memory (``lowrank.lowrank``, what ``compress --method lowrank`` runs), perplexity ratio and KL
against the baseline on the first tokens of the shipped test sample (the validation job's ``compare``,
float32). Prints one line per configuration; for the full test file use ``bench_compress.py`` on a GPU.

    python tests/benchmarks/bench_lowrank_slice.py --threads 1 --runs svdllm:4x128:0.9 svdllm:32x256:0.9 \\
        asvd:32x256:0.9 svd:0x0:0.9
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from squeezeserve.service.compress.calibration import calibration_batches
from squeezeserve.service.compress.lowrank import lowrank
from squeezeserve.service.compress.pipeline import load_float32, target_linears
from squeezeserve.service.datasets import sample_path
from squeezeserve.service.validate.accuracy import LocalScorer, compare
from squeezeserve.service.validate.data import sliding_windows, tokenize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--baseline", help="baseline checkpoint (default: export the bundled model)")
    parser.add_argument("--runs", nargs="+", required=True, help="ALGORITHM:SAMPLESxSEQ_LEN:RATIO")
    parser.add_argument("--tokens", type=int, default=1024, help="evaluation tokens (window 256, stride 192)")
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.baseline:
        baseline = Path(args.baseline)
    else:
        from squeezeserve.service.models.bundled import export_baseline

        baseline = export_baseline().path
    tokenizer = AutoTokenizer.from_pretrained(baseline)
    text = sample_path("wikitext-2-test").read_text(encoding="utf-8")
    windows = sliding_windows(tokenize(tokenizer, text, args.tokens), 256, 192)
    model = load_float32(baseline, "cpu")
    reference = LocalScorer(model, tokenizer)
    for run in args.runs:
        algorithm, size, ratio = run.split(":")
        samples, seq_len = (int(v) for v in size.split("x"))
        start = time.perf_counter()
        calibration = None
        if algorithm != "svd":
            calibration = calibration_batches(
                sample_path("wikitext-2-calibration"), tokenizer, samples, seq_len
            )
        candidate = copy.deepcopy(model)
        result = lowrank(candidate, target_linears(candidate), float(ratio), algorithm, calibration)
        side_b, side_c, fidelity = compare(reference, LocalScorer(candidate, tokenizer), windows)
        dense = sum(rank is None for rank in result.ranks.values())
        print(  # noqa: T201
            f"{run}: ppl {side_c.perplexity / side_b.perplexity:.3f}x (baseline {side_b.perplexity:.2f}), "
            f"KL {fidelity.kl_mean:.3f}, top-1 {fidelity.top1_agreement:.3f}, parameters "
            f"{result.parameters['after'] / result.parameters['before']:.3f}, {dense} of {len(result.ranks)} "
            f"linears dense, {time.perf_counter() - start:.0f} s, load {os.getloadavg()[0]:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
