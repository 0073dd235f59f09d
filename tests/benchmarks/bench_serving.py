"""Serving benchmark: TTFT, TPOT and throughput of one OpenAI-compatible endpoint, as CSV rows.

A thin driver over ``squeezeserve.service.validate.latency`` (the load generator ``squeezeserve validate``
uses; its docstring defines TTFT, TPOT and the throughputs): per concurrency c, after its uncounted
warm-up, ``--requests-per-level`` streamed ``/v1/completions`` requests (default 4c, at least 8) with at
most c in flight. Prompts are token ids, exactly ``--prompt-tokens`` each and a different random sequence
per request (no shared prefix-cache hits); outputs exactly ``--output-tokens`` (``ignore_eos``), greedy.
For a run against one endpoint where ``squeezeserve validate`` needs a baseline and a candidate side (the
8B-class synthetic model of tests/gpu/run_h100.sh).

Rows (p20/p50/p80 of TTFT and TPOT in ms, output tokens/s and requests/s over the level's wall time) are
appended to ``--csv`` with the label, model, device and versions.

    python3 tests/benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --model m --label bf16 \\
        --concurrency 1 16 64 --csv results.csv
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime
import os
import random
from pathlib import Path

from squeezeserve.service.validate import latency

FIELDS = [
    "run", "label", "model", "concurrency", "requests", "prompt_tokens", "output_tokens",
    "ttft_ms_p20", "ttft_ms_p50", "ttft_ms_p80", "tpot_ms_p20", "tpot_ms_p50", "tpot_ms_p80",
    "output_tok_per_s", "requests_per_s", "errors", "device", "versions", "date",
]  # fmt: skip
QUANTILES = (20, 50, 80)


def random_prompts(length: int, vocab: int, seed: int):
    """``prompts(i)`` for latency.sweep_levels: request i's ids (negative i: warm-up), each distinct.
    Ids from 1000 up: past the special tokens of common tokenizers."""

    def prompt(index: int) -> list[int]:
        rng = random.Random(f"{seed}:{index}")
        return [rng.randrange(1000, vocab) for _ in range(length)]

    return prompt


def level_row(level: latency.Level) -> dict[str, object]:
    """The CSV columns for one level (timings in ms over the completed requests)."""
    done = [r for r in level.records if r.ok]
    if not done:
        errors = sorted({r.error or "" for r in level.records})
        raise RuntimeError(f"every request failed at concurrency {level.concurrency}: {errors[:3]}")
    row: dict[str, object] = {"concurrency": level.concurrency, "requests": len(done)}
    samples = {"ttft": [r.ttft for r in done if r.ttft is not None], "tpot": [r.tpot for r in done]}
    for name, values in samples.items():
        ms = [1000 * v for v in values if v is not None]
        for q in QUANTILES:
            row[f"{name}_ms_p{q}"] = latency.percentile(ms, q)
    row["output_tok_per_s"] = sum(r.output_tokens or 0 for r in done) / level.wall_s
    row["requests_per_s"] = len(done) / level.wall_s
    row["errors"] = len(level.records) - len(done)
    return row


def append_rows(path: Path, rows: list[dict[str, object]]) -> None:
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in row.items()})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", required=True, help="server root or its /v1")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--run", default="serving", help="which experiment (CSV column)")
    parser.add_argument("--label", required=True, help="configuration name (CSV column)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--requests-per-level", type=int, default=0, help="0: max(8, 4 x concurrency)")
    parser.add_argument("--warmup-requests", type=int, default=4, help="uncounted requests per level")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=49152, help="prompt ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", type=Path, required=True)
    parser.add_argument("--device", default=os.environ.get("BENCH_DEVICE", ""))
    parser.add_argument("--versions", default=os.environ.get("BENCH_VERSIONS", ""))
    args = parser.parse_args()
    if min(args.concurrency) < 1 or args.prompt_tokens < 1 or args.output_tokens < 2:
        parser.error("concurrency and prompt tokens must be >= 1, output tokens >= 2")
    if args.vocab <= 1000 or args.requests_per_level < 0 or args.warmup_requests < 0:
        parser.error("--vocab must exceed 1000; request counts must be >= 0")
    settings = latency.LoadSettings(
        concurrency=args.concurrency,
        requests_per_level=args.requests_per_level or None,
        duration_s=None,
        output_tokens=args.output_tokens,
        warmup_requests=args.warmup_requests,
        slo_ttft_ms=None,
        slo_tpot_ms=None,
    )
    base = args.base_url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    prompts = random_prompts(args.prompt_tokens, args.vocab, args.seed)
    levels = asyncio.run(latency.sweep_levels(base, args.model, None, prompts, settings))
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    rows = []
    for level in levels:
        row = {
            "run": args.run, "label": args.label, "model": args.model, **level_row(level),
            "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
            "device": args.device, "versions": args.versions, "date": date,
        }  # fmt: skip
        rows.append(row)
        print(
            f"{args.run} {args.label} c={level.concurrency}: TTFT p50 {row['ttft_ms_p50']:.1f} ms, TPOT p50 "
            f"{row['tpot_ms_p50']:.2f} ms, {row['output_tok_per_s']:.0f} tok/s, errors {row['errors']}",
            flush=True,
        )
    append_rows(args.csv, rows)


if __name__ == "__main__":
    main()
