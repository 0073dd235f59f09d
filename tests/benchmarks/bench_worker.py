"""Embedded CPU worker speed: single-stream decode and aggregate throughput under concurrency.

    python tests/benchmarks/bench_worker.py --model BASELINE_DIR [--dtype auto] [--concurrency 1,4,8,16]

Starts ``squeezeserve worker --engine local`` (the validation job's WorkerProcess), drives it with the
validation job's streaming load generator (64-token prompts, 128 output tokens, warm-up not counted) and
appends one row per concurrency level to ``results/worker_cpu.csv`` with the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime
import os
import platform
import sys
from pathlib import Path

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from cpu_common import TEXT, cpu_description  # noqa: E402

from squeezeserve.service.validate.latency import LoadSettings, sweep  # noqa: E402
from squeezeserve.service.validate.server import WorkerProcess  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "worker_cpu.csv"
FIELDS = [
    "date", "machine", "cores", "load_before", "model", "dtype", "concurrency", "prompt_tokens",
    "output_tokens", "ttft_p50_ms", "tpot_p50_ms", "tpot_p90_ms", "single_stream_tok_s",
    "output_tok_s", "requests",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=None, help="per level (default 4 x c, at least 8)")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    ids = AutoTokenizer.from_pretrained(args.model)(TEXT)["input_ids"][:64]
    load_before = os.getloadavg()[0]
    settings = LoadSettings(levels, args.requests, None, args.output_tokens, 2, None, None)
    with WorkerProcess(Path(args.model), "bench", "local", args.dtype, max(levels)) as worker:
        rows = asyncio.run(
            sweep(f"{worker.url}/v1", "bench", None, lambda i: ids[: 48 + abs(i) % 16], settings)
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    new = not RESULTS.exists()
    with RESULTS.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        for row in rows:
            out = {
                "date": datetime.date.today().isoformat(),
                "machine": f"{cpu_description()[0]} ({platform.machine()})",
                "cores": os.cpu_count(),
                "load_before": f"{load_before:.2f}",
                "model": Path(args.model).name,
                "dtype": args.dtype,
                "concurrency": row["concurrency"],
                "prompt_tokens": f"{row['prompt_tokens_mean']:.0f}",
                "output_tokens": row["output_tokens"],
                "ttft_p50_ms": f"{row['ttft_p50_ms']:.1f}",
                "tpot_p50_ms": f"{row['tpot_p50_ms']:.1f}",
                "tpot_p90_ms": f"{row['tpot_p90_ms']:.1f}",
                "single_stream_tok_s": f"{1000 / row['tpot_p50_ms']:.1f}",
                "output_tok_s": f"{row['output_throughput']:.1f}",
                "requests": row["completed"],
            }
            writer.writerow(out)
            print(  # noqa: T201
                f"c={out['concurrency']:>3}  TTFT p50 {out['ttft_p50_ms']:>7} ms"
                f"  TPOT p50 {out['tpot_p50_ms']:>6} ms ({out['single_stream_tok_s']} tok/s per stream)"
                f"  {out['output_tok_s']} output tok/s"
            )


if __name__ == "__main__":
    main()
