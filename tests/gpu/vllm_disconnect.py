"""Issue 15.3 on the device: a client that closes a stream after a few tokens stops generation in vLLM.

    python3 tests/gpu/vllm_disconnect.py --worker http://127.0.0.1:8001 --gateway http://127.0.0.1:8100 \
        --model baseline --trials 5 --csv OUT.csv

Each trial streams one long completion (``ignore_eos``, thousands of tokens: tens of seconds of work at
vLLM's single-stream speed), reads a few SSE events and then for one second more (vLLM's metrics while it
runs), closes the connection, and then polls vLLM's own ``/metrics`` every 20 ms: the time from the hang-up
until ``vllm:generation_tokens_total`` last grew (then unchanged for 0.5 s, while an uncancelled request
adds hundreds of tokens a second) is the stop latency; ``vllm:num_requests_running`` after it is recorded
beside it. Trials go straight to vLLM and through our gateway (which must pass the hang-up on to its
upstream). A row per trial goes to the CSV; the exit code is 1 if any trial took longer than --limit-s (1 s,
the issue's bound) or never stopped.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
import time

import httpx

METRIC = re.compile(r"^(vllm:num_requests_running|vllm:generation_tokens_total)(\{[^}]*\})? (\S+)$")
FIELDS = ["path", "trial", "hung_up_at", "events_read", "running_before", "tokens_while_reading_1s", "stop_s",
          "tokens_after_hangup", "running_after", "ok"]  # fmt: skip


def sample(worker: str) -> tuple[float, float]:
    """(requests running, generation tokens so far) from vLLM's Prometheus text (summed over labels)."""
    running = tokens = 0.0
    for line in httpx.get(f"{worker}/metrics", timeout=10).text.splitlines():
        match = METRIC.match(line)
        if match and match.group(1) == "vllm:num_requests_running":
            running += float(match.group(3))
        elif match:
            tokens += float(match.group(3))
    return running, tokens


def trial(base: str, worker: str, model: str, events: int, limit_s: float) -> dict:
    body = {"model": model, "prompt": "Write a very long essay about the sea.", "max_tokens": 6000,
            "ignore_eos": True, "stream": True, "temperature": 0}  # fmt: skip
    read = 0
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                read += 1
                if read >= events:
                    break
        # keep reading for a second: the metrics while it runs, to compare with those after the hang-up
        _, tokens_reading = sample(worker)
        until = time.monotonic() + 1.0
        for line in lines:
            read += line.startswith("data: ")
            if time.monotonic() > until:
                break
        running_before, tokens_at_hangup = sample(worker)
        hung_up_wall = time.time()
    hung_up = time.monotonic()  # leaving both `with` blocks closed the response and the connection
    stopped = None
    last_tokens, stable_since = tokens_at_hangup, hung_up
    while time.monotonic() - hung_up < 15:
        running, tokens = sample(worker)
        now = time.monotonic()
        if tokens != last_tokens:
            last_tokens, stable_since = tokens, now
        if now - stable_since >= 0.5:
            stopped = stable_since - hung_up if stable_since > hung_up else 0.0
            break
        time.sleep(0.02)
    running, tokens = sample(worker)
    stop_s = round(stopped, 3) if stopped is not None else None
    return {
        "hung_up_at": round(hung_up_wall, 3),
        "events_read": read,
        "running_before": int(running_before),
        "tokens_while_reading_1s": int(tokens_at_hangup - tokens_reading),
        "stop_s": stop_s,
        "tokens_after_hangup": int(tokens - tokens_at_hangup),
        "running_after": int(running),
        "ok": stop_s is not None and stop_s <= limit_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", required=True, help="vLLM's base URL (its /metrics is read)")
    parser.add_argument("--gateway", help="our gateway in front of it (trials through it as well)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--events", type=int, default=5, help="SSE events read before hanging up")
    parser.add_argument("--limit-s", type=float, default=1.0)
    parser.add_argument("--csv", required=True)
    args = parser.parse_args()

    rows = []
    paths = [("vllm", args.worker)] + ([("gateway", args.gateway)] if args.gateway else [])
    for path, base in paths:
        for i in range(args.trials):
            measured = trial(base, args.worker, args.model, args.events, args.limit_s)
            row = {"path": path, "trial": i, **measured}
            print(row, flush=True)
            rows.append(row)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} trials stopped within {args.limit_s} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
