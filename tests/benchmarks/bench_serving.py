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

Where the server (or ``--metrics-root``) exposes vLLM's Prometheus ``/metrics``, each level also prints
where the server's own time went: its histograms are read after the level's warm-up and after its last
request, and the differences give the level's means (``server_line``): vLLM's TTFT (from the request's
arrival in its front end), the time its requests waited for the scheduler and spent in prefill, and the
tokens an engine step ran. A client TTFT well above vLLM's is the client's or the network's; a vLLM TTFT
well above queue + prefill is its front end's (request handling, output streaming) on the CPUs it has.

    python3 tests/benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --model m --label bf16 \\
        --concurrency 1 16 64 --csv results.csv
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import csv
import dataclasses
import datetime
import os
import random
from functools import partial
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from squeezeserve.service.validate import latency

FIELDS = [
    "run", "label", "model", "concurrency", "requests", "prompt_tokens", "output_tokens",
    "ttft_ms_p20", "ttft_ms_p50", "ttft_ms_p80", "tpot_ms_p20", "tpot_ms_p50", "tpot_ms_p80",
    "output_tok_per_s", "requests_per_s", "errors", "device", "versions", "date",
]  # fmt: skip
QUANTILES = (20, 50, 80)
# vLLM's histograms a level's server line reads (their _sum and _count samples, summed over label sets).
SERVER_HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "step_tokens": "vllm:iteration_tokens_total",
}


def scrape(root: str) -> dict[str, float] | None:
    """The _sum and _count of each SERVER_HISTOGRAMS entry on ``root``/metrics (summed over label sets), or
    None where the server has no such endpoint (not vLLM, or metrics off)."""
    try:
        response = httpx.get(f"{root}/metrics", timeout=10.0)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    wanted = {name: key for key, name in SERVER_HISTOGRAMS.items()}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        key = wanted.get(family.name)
        if key is None:
            continue
        for sample in family.samples:
            for suffix in ("_sum", "_count"):
                if sample.name == family.name + suffix:
                    totals[key + suffix] = totals.get(key + suffix, 0.0) + sample.value
    return totals or None


def _scrape_into(found: list, root: str, *_level) -> None:
    found.append(scrape(root))


def server_line(before: dict[str, float] | None, after: dict[str, float] | None) -> str | None:
    """The level's server-side means from two scrapes (module docstring), or None without both."""
    if before is None or after is None:
        return None
    means = {}
    for key in SERVER_HISTOGRAMS:
        count = after.get(key + "_count", 0.0) - before.get(key + "_count", 0.0)
        total = after.get(key + "_sum", 0.0) - before.get(key + "_sum", 0.0)
        means[key] = total / count if count > 0 else None
    if any(means[k] is None for k in ("ttft", "queue", "prefill")):
        return None
    line = (f"vLLM TTFT mean {1000 * means['ttft']:.1f} ms (queue {1000 * means['queue']:.1f} + prefill "
            f"{1000 * means['prefill']:.1f})")  # fmt: skip
    if means["step_tokens"] is not None:
        line += f", {means['step_tokens']:.0f} tokens a step"
    return line


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


def error_summary(level: latency.Level, most: int = 3) -> str | None:
    """The level's failed requests by message, most frequent first (``most`` kinds), or None if none failed:
    a count in the CSV alone does not say whether the server or the prompt failed."""
    counts = collections.Counter(r.error or "no message" for r in level.records if not r.ok)
    if not counts:
        return None
    kinds = [f"{n} x {message}" for message, n in counts.most_common(most)]
    if len(counts) > most:
        kinds.append(f"{len(counts) - most} other kinds")
    return "; ".join(kinds)


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
    parser.add_argument(
        "--metrics-root",
        help="where vLLM's /metrics is read (default: the server's root; behind a gateway, "
        "the vLLM server's own)",
    )
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
    root = (args.metrics_root or base.removesuffix("/v1")).rstrip("/")
    levels, servers = [], []
    for concurrency in args.concurrency:  # one level at a time: the server's histograms are read around it
        scrapes: list[dict[str, float] | None] = []  # (after the warm-up: sweep_levels' on_level)
        one = dataclasses.replace(settings, concurrency=[concurrency])
        levels += asyncio.run(
            latency.sweep_levels(base, args.model, None, prompts, one, partial(_scrape_into, scrapes, root))
        )
        servers.append(server_line(scrapes[0], scrape(root)))
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    rows = []
    for level, server in zip(levels, servers, strict=True):
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
        if server is not None:
            print(f"{args.run} {args.label} c={level.concurrency} server: {server}", flush=True)
        failed = error_summary(level)
        if failed is not None:
            print(f"{args.run} {args.label} c={level.concurrency} failed: {failed}", flush=True)
    append_rows(args.csv, rows)


if __name__ == "__main__":
    main()
