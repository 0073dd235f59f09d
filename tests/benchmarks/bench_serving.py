"""Serving benchmark: TTFT, TPOT and throughput of an OpenAI-compatible endpoint at fixed concurrency.

For each concurrency c, ``requests_per_level`` streamed ``/v1/completions`` requests (default 4c, at
least 8) go out with at most c in flight. Prompts are token ids (exactly ``--prompt-tokens`` each, a
different random sequence per request so no prefix cache hit is shared), outputs are exactly
``--output-tokens`` (``ignore_eos``), greedy. Per request:

    TTFT = time of the first streamed token - send time
    TPOT = (time of the last token - time of the first token) / (output tokens - 1)

Rows (p20/p50/p80 of TTFT and TPOT in ms, output tokens/s over the level's wall time, request/s) are
appended to ``--csv`` with the label, model, device and vLLM version. Works through our gateway or
straight against a worker.

    python3 tests/benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --model m --label bf16 \
        --concurrency 1 16 64 --csv results.csv
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime
import json
import os
import random
import time
from pathlib import Path

import httpx

FIELDS = [
    "run", "label", "model", "concurrency", "requests", "prompt_tokens", "output_tokens",
    "ttft_ms_p20", "ttft_ms_p50", "ttft_ms_p80", "tpot_ms_p20", "tpot_ms_p50", "tpot_ms_p80",
    "output_tok_per_s", "requests_per_s", "errors", "device", "versions", "date",
]  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, float, int]:
    """(TTFT s, TPOT s, tokens) of one streamed completion."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    first = last = None
    chunks = 0
    usage_tokens = None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
            if event.get("choices") and event["choices"][0].get("text") is not None:
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
    if first is None:
        raise RuntimeError("stream ended without a token")
    tokens = usage_tokens or chunks
    tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
    return first - start, tpot, tokens


async def run_level(
    base_url: str, model: str, concurrency: int, requests: int, prompt_tokens: int, output_tokens: int,
    vocab: int, seed: int,
) -> dict[str, float]:  # fmt: skip
    rng = random.Random(seed * 1000 + concurrency)
    # Ids from 1000 up: past the special tokens of common tokenizers.
    prompts = [[rng.randrange(1000, vocab) for _ in range(prompt_tokens)] for _ in range(requests)]
    gate = asyncio.Semaphore(concurrency)
    url = base_url.rstrip("/") + "/v1/completions"
    results: list[tuple[float, float, int]] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def worker(prompt: list[int]) -> None:
            async with gate:
                try:
                    results.append(await one_request(client, url, model, prompt, output_tokens))
                except (httpx.HTTPError, RuntimeError) as exc:
                    errors.append(str(exc))

        start = time.perf_counter()
        await asyncio.gather(*(worker(p) for p in prompts))
        wall = time.perf_counter() - start
    if not results:
        raise RuntimeError(f"every request failed at concurrency {concurrency}: {errors[:3]}")
    ttft = [1000 * r[0] for r in results]
    tpot = [1000 * r[1] for r in results]
    stats: dict[str, float] = {"requests": len(results)}
    for name, values in (("ttft", ttft), ("tpot", tpot)):
        for q in (20, 50, 80):
            stats[f"{name}_ms_p{q}"] = percentile(values, q)
    stats["output_tok_per_s"] = sum(r[2] for r in results) / wall
    stats["requests_per_s"] = len(results) / wall
    stats["errors"] = len(errors)
    return stats


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
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--run", default="serving", help="which experiment (CSV column)")
    parser.add_argument("--label", required=True, help="configuration name (CSV column)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--requests-per-level", type=int, default=0, help="0: max(8, 4 x concurrency)")
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
    # Warm-up: the first requests pay for autotuning and allocator growth.
    asyncio.run(run_level(args.base_url, args.model, 4, 4, args.prompt_tokens, 8, args.vocab, args.seed + 99))
    rows = []
    for c in args.concurrency:
        n = args.requests_per_level or max(8, 4 * c)
        stats = asyncio.run(
            run_level(
                args.base_url, args.model, c, n, args.prompt_tokens, args.output_tokens, args.vocab, args.seed
            )
        )
        row = {
            "run": args.run, "label": args.label, "model": args.model, "concurrency": c,
            "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, **stats,
            "device": args.device, "versions": args.versions,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }  # fmt: skip
        rows.append(row)
        print(
            f"{args.run} {args.label} c={c}: TTFT p50 {stats['ttft_ms_p50']:.1f} ms, TPOT p50 "
            f"{stats['tpot_ms_p50']:.2f} ms, {stats['output_tok_per_s']:.0f} tok/s, errors {stats['errors']}",
            flush=True,
        )
    append_rows(args.csv, rows)


if __name__ == "__main__":
    main()
