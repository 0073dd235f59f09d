"""Scale-out benchmarks through the gateway: replica throughput (with a worker killed mid-run) and
shared-prefix routing. Rows go to ``--csv`` with the device and the date.

``throughput``: non-streamed ``/v1/completions`` (random token-id prompts, exactly ``--output-tokens``
each, ``ignore_eos``), at most c in flight, ``--requests`` in all; output tokens/s over the wall time.
Non-streamed, so the figure is the engines' and not the gateway's per-chunk relay. With ``--kill-pid P
--kill-after S`` the process group of P gets SIGKILL S seconds in: every request must still complete
(the gateway retries those the dead worker never answered).

``prefix``: ``--prefixes`` long system prompts (``--prefix-words`` words each), each shared by many users
asking short questions, streamed, at most c in flight, routed by the strategy the
``X-Squeezeserve-Routing`` header names (one run per ``--routing`` value, each with its own fresh prompts,
so no run reuses another's cache). Reads every worker's ``/metrics`` before and after: the prefix-cache
hit rate is hits / queries over the run (vLLM counts both in tokens).

    python3 tests/benchmarks/bench_scale.py throughput --gateway URL --model M --concurrency 64 256 --label 2x
    python3 tests/benchmarks/bench_scale.py prefix --gateway URL --model M --workers URL1 URL2 \\
        --routing least_outstanding prefix_affinity --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime
import os
import random
import signal
import statistics
import time
from pathlib import Path

import httpx

WORDS = (
    "system policy assistant answer careful detail review customer account order shipping refund product "
    "warranty invoice schedule support ticket priority escalation summary context history request response "
    "language format style guide example section paragraph sentence table number date time region market"
).split()


async def _post(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> dict:
    response = await client.post(url, json=body, headers=headers)
    response.raise_for_status()
    return response.json()


async def throughput(args: argparse.Namespace, concurrency: int) -> dict[str, object]:
    rng = random.Random(f"{args.seed}:{concurrency}")
    url = f"{args.gateway}/v1/completions"
    done = errors = tokens = 0
    sem = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal done, errors, tokens
        prompt = [rng.randrange(1000, args.vocab) for _ in range(args.prompt_tokens)]
        body = {"model": args.model, "prompt": prompt, "max_tokens": args.output_tokens,
                "ignore_eos": True, "temperature": 0}  # fmt: skip
        async with sem:
            try:
                answer = await _post(client, url, body, {})
                tokens += answer["usage"]["completion_tokens"]
                done += 1
            except (httpx.HTTPError, KeyError) as exc:
                errors += 1
                print(f"error: {type(exc).__name__}: {exc}"[:200])  # noqa: T201

    async def killer() -> None:
        await asyncio.sleep(args.kill_after)
        os.killpg(os.getpgid(args.kill_pid), signal.SIGKILL)
        print(f"killed worker pid {args.kill_pid} after {args.kill_after} s")  # noqa: T201

    # Idle connections expire before the server's 5 s keep-alive does: reusing one the server is closing
    # would fail a request that the gateway never saw.
    limits = httpx.Limits(
        max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(one(client) for _ in range(min(concurrency, 16))))  # warm-up, not counted
        done = errors = tokens = 0
        start = time.perf_counter()
        tasks = [one(client) for _ in range(args.requests or 4 * concurrency)]
        kill = [killer()] if args.kill_pid else []
        await asyncio.gather(*tasks, *kill)
        wall = time.perf_counter() - start
    return {"concurrency": concurrency, "requests": done, "errors": errors, "output_tok_s": tokens / wall,
            "wall_s": wall}  # fmt: skip


async def _prefix_counters(client: httpx.AsyncClient, workers: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for worker in workers:
        text = (await client.get(f"{worker}/metrics")).text
        for line in text.splitlines():
            if line.startswith("#") or "prefix_cache" not in line or "external" in line:
                continue
            name, value = line.rsplit(" ", 1)
            if "prefix_cache_hits" in name:
                hits += float(value)
            elif "prefix_cache_queries" in name:
                queries += float(value)
    return hits, queries


async def prefix(args: argparse.Namespace, routing: str, concurrency: int) -> dict[str, object]:
    rng = random.Random(f"{args.seed}:{routing}:{concurrency}")
    systems = [" ".join(rng.choice(WORDS) for _ in range(args.prefix_words)) for _ in range(args.prefixes)]
    url = f"{args.gateway}/v1/completions"
    headers = {"X-Squeezeserve-Routing": routing}
    ttfts: list[float] = []
    errors = 0
    sem = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, user: int) -> None:
        nonlocal errors
        system = systems[user % len(systems)]
        question = " ".join(rng.choice(WORDS) for _ in range(12))
        prompt = f"{system}\nUser {user}: {question}?\nAnswer:"
        body = {"model": args.model, "prompt": prompt, "max_tokens": args.output_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
        async with sem:
            start = time.perf_counter()
            try:
                async with client.stream("POST", url, json=body, headers=headers) as response:
                    response.raise_for_status()
                    lines = response.aiter_lines()
                    async for line in lines:
                        if line.startswith("data: ") and line != "data: [DONE]":
                            ttfts.append(time.perf_counter() - start)
                            break
                    async for _ in lines:  # the rest of the stream
                        pass
            except httpx.HTTPError as exc:
                errors += 1
                print(f"error: {type(exc).__name__}: {exc}"[:200])  # noqa: T201

    limits = httpx.Limits(keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        hits0, queries0 = await _prefix_counters(client, args.workers)
        start = time.perf_counter()
        await asyncio.gather(*(one(client, u) for u in range(args.requests or 8 * concurrency)))
        wall = time.perf_counter() - start
        hits1, queries1 = await _prefix_counters(client, args.workers)
    ttfts.sort()
    queries = queries1 - queries0
    hit_rate = (hits1 - hits0) / queries if queries else float("nan")
    p50, p90 = 1000 * statistics.median(ttfts), 1000 * ttfts[int(0.9 * len(ttfts))]
    return {"routing": routing, "concurrency": concurrency, "requests": len(ttfts), "errors": errors,
            "ttft_ms_p50": p50, "ttft_ms_p90": p90, "prefix_hit_rate": hit_rate, "wall_s": wall}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["throughput", "prefix"])
    parser.add_argument("--gateway", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--label", default="")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64])
    parser.add_argument("--requests", type=int, default=0, help="per level (throughput: 4c; prefix: 8c)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-pid", type=int, default=0, help="throughput: SIGKILL this process group")
    parser.add_argument("--kill-after", type=float, default=5.0)
    parser.add_argument("--workers", nargs="*", default=[], help="prefix: worker base URLs (/metrics)")
    parser.add_argument("--routing", nargs="+", default=["least_outstanding", "prefix_affinity"])
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--prefix-words", type=int, default=800)
    parser.add_argument("--csv", type=Path, required=True)
    parser.add_argument("--device", default=os.environ.get("BENCH_DEVICE", ""))
    args = parser.parse_args()
    rows = []
    for c in args.concurrency:
        if args.mode == "throughput":
            rows.append(asyncio.run(throughput(args, c)))
        else:
            rows.extend(asyncio.run(prefix(args, routing, c)) for routing in args.routing)
    meta = {"mode": args.mode, "label": args.label, "model": args.model, "device": args.device,
            "date": datetime.date.today().isoformat()}  # fmt: skip
    fields = ["mode", "label", "model", "routing", "concurrency", "requests", "errors", "output_tok_s",
              "ttft_ms_p50", "ttft_ms_p90", "prefix_hit_rate", "wall_s", "device", "date"]  # fmt: skip
    new = not args.csv.exists()
    with args.csv.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new:
            writer.writeheader()
        for row in rows:
            row = {**meta, **{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}}
            writer.writerow(row)
            print(row)  # noqa: T201


if __name__ == "__main__":
    main()
