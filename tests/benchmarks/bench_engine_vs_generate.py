"""One stream, two ways, in one run: transformers ``generate`` in this process vs our embedded worker over
HTTP (``squeezeserve worker --engine local``), same checkpoint, dtype, prompt and thread count.

    python tests/benchmarks/bench_engine_vs_generate.py --model BASELINE_DIR [--rounds 3] [--dtype bfloat16]

Rounds alternate the two (generate, worker, generate, worker, ...) so that load from other processes hits
both alike. Decode speed excludes the first token on both sides: ``generate`` is timed for 1 and for N new
tokens, (N - 1) / (t_N - t_1); the worker's is 1 / TPOT of a streamed request (``ignore_eos``). Rows go to
``results/engine_vs_generate.csv`` with the CPU model, its vector flags, the thread count and the load.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from cpu_common import TEXT, append_rows, cpu_description  # noqa: E402

from squeezeserve.service.validate.latency import LoadSettings, sweep  # noqa: E402
from squeezeserve.service.validate.server import WorkerProcess  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "engine_vs_generate.csv"
FIELDS = ["date", "cpu", "flags", "threads", "load_before", "load_after", "model", "dtype", "provider",
          "round", "prompt_tokens", "output_tokens", "decode_tok_s", "ttft_ms"]  # fmt: skip


def generate_speed(model, ids: torch.Tensor, tokens: int) -> tuple[float, float]:
    """(decode tok/s, first-token ms) of greedy ``generate`` producing exactly ``tokens`` new tokens."""
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        whole = time.perf_counter() - start
    return (tokens - 1) / (whole - first), 1000 * first


def worker_speed(url: str, ids: list[int], tokens: int) -> tuple[float, float]:
    settings = LoadSettings([1], 3, None, tokens, 1, None, None)
    (row,) = asyncio.run(sweep(f"{url}/v1", "bench", None, lambda i: ids, settings))
    return 1000 / row["tpot_p50_ms"], row["ttft_p50_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=128)
    args = parser.parse_args()
    threads = len(os.sched_getaffinity(0))  # what the worker takes by default
    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer(TEXT)["input_ids"][:55]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    cpu, flags = cpu_description()
    load_before = os.getloadavg()[0]
    rows = []
    with WorkerProcess(Path(args.model), "bench", "local", args.dtype, 1) as worker:
        worker_speed(worker.url, ids, 16)  # warm-up, not counted
        generate_speed(model, torch.tensor([ids]), 16)
        for round_ in range(args.rounds):
            for provider in ("generate", "worker"):
                if provider == "generate":
                    speed, ttft = generate_speed(model, torch.tensor([ids]), args.output_tokens)
                else:
                    speed, ttft = worker_speed(worker.url, ids, args.output_tokens)
                rows.append({"provider": provider, "round": round_, "decode_tok_s": speed, "ttft_ms": ttft})
                print(f"round {round_} {provider:>8}: {speed:5.1f} tok/s, first token {ttft:6.1f} ms")  # noqa: T201
    meta = {"date": datetime.date.today().isoformat(), "cpu": cpu, "flags": flags, "threads": threads,
            "load_before": f"{load_before:.2f}", "load_after": f"{os.getloadavg()[0]:.2f}",
            "model": Path(args.model).name, "dtype": args.dtype, "prompt_tokens": len(ids),
            "output_tokens": args.output_tokens}  # fmt: skip
    append_rows(RESULTS, FIELDS, [{**meta, **row, "decode_tok_s": f"{row['decode_tok_s']:.2f}",
                                   "ttft_ms": f"{row['ttft_ms']:.1f}"} for row in rows])  # fmt: skip
    for provider in ("generate", "worker"):
        median = statistics.median(r["decode_tok_s"] for r in rows if r["provider"] == provider)
        print(f"median {provider:>8}: {median:5.1f} tok/s")  # noqa: T201


if __name__ == "__main__":
    main()
