"""Soak: minutes of mixed load through the gateway to a real embedded worker; memory, errors and p99 per
minute, and whether they held.

    python tests/benchmarks/soak.py                          # 10 minutes, result in results/soak.json
    python tests/benchmarks/soak.py --minutes 2 --warmup-minutes 1 --out /tmp/soak.json

Starts ``squeezeserve worker --engine local`` (the bundled baseline, ``--threads`` 1 by default) and
``squeezeserve gateway`` in front of it, each a process of its own, then keeps ``--concurrency`` clients
busy with the chaos tests' mixed load (``tests/service/gateway/mixed_load.py``: streamed and non-streamed,
completions and chat, every answer checked on the wire). Every ``--sample-seconds`` it reads both processes'
resident memory (``VmRSS`` in ``/proc/PID/status``); per minute it records requests, errors, latency p50/p99
(streamed and not, apart: they ask for different token counts; with some 30 of each a minute, p99 is in
effect the minute's slowest), the median and largest RSS of each process and the load average.

Verdicts, after the warm-up minutes (the first requests grow caches, allocator pools, the KV cache's
largest batch): each process's RSS in the last minute within ``--max-growth`` (5%) of its RSS in the first
minute after the warm-up (the median of each minute's samples: the worker's RSS swings by tens of MiB with
the batch it holds, and a sample at one peak would say nothing about a leak); no error in the whole run;
p99 stable: the mean per-minute p99 of the later half of the measured minutes at most ``--max-p99-drift``
(1.25x) that of the earlier half, for each kind. The machine's CPU model, core count and load average go
with the result: on a shared machine the p99 moves with other people's work, which the load average
column shows.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_gateway import _cpu_info, _loadavg

from squeezeserve.service.processes import free_port, stop_process, wait_until_healthy

HERE = Path(__file__).parent
RESULT = HERE / "results" / "soak.json"
_spec = importlib.util.spec_from_file_location(
    "mixed_load", HERE.parent / "service" / "gateway" / "mixed_load.py"
)
assert _spec is not None and _spec.loader is not None
load = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = load  # dataclasses look their module up there
_spec.loader.exec_module(load)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "squeezeserve.service.cli", "--log-level", "WARNING", *args]


def start_servers(model: str, threads: int) -> tuple[str, subprocess.Popen, subprocess.Popen]:
    """The worker and the gateway in front of it; returns the gateway's URL and both processes."""
    worker_port, gateway_port = free_port(), free_port()
    worker = subprocess.Popen(
        _cli("worker", "--engine", "local", "--model", model, "--port", str(worker_port))
        + ["--served-model-name", load.MODEL, "--threads", str(threads)]
    )
    worker_url = f"http://127.0.0.1:{worker_port}"
    wait_until_healthy(worker_url, timeout=300, process=worker)
    gateway = subprocess.Popen(_cli("gateway", "--upstream", worker_url, "--port", str(gateway_port)))
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    wait_until_healthy(gateway_url, timeout=60, process=gateway)
    return gateway_url, worker, gateway


async def soak(
    gateway: str, pids: dict[str, int], args: argparse.Namespace
) -> tuple[list, list[dict[str, object]], float]:
    """Run the load for ``args.minutes``; the outcomes, the memory samples and the start time."""
    started = time.monotonic()
    stop_at = started + 60 * args.minutes
    jobs = (load.mixed_job(i, args.stream_tokens, args.plain_tokens) for i in itertools.count())
    samples: list[dict[str, object]] = []

    async def sample() -> None:
        while True:
            row: dict[str, object] = {"t": time.monotonic() - started, "loadavg": _loadavg()}
            row.update({f"{name}_rss_mib": rss_mib(pid) for name, pid in pids.items()})
            samples.append(row)
            await asyncio.sleep(args.sample_seconds)

    sampler = asyncio.create_task(sample())
    try:
        outcomes = await load.run_load(gateway, jobs, args.concurrency, stop_at=stop_at)
    finally:
        sampler.cancel()
    return [o for o in outcomes if o.started < stop_at], samples, started


def per_minute(outcomes: list, samples: list[dict[str, object]], started: float, minutes: int) -> list[dict]:
    rows = []
    for minute in range(minutes):
        ended = [o for o in outcomes if minute * 60 <= o.started + o.seconds - started < (minute + 1) * 60]
        in_minute = [s for s in samples if minute * 60 <= float(s["t"]) < (minute + 1) * 60]
        row: dict[str, object] = {
            "minute": minute + 1,
            "requests": len(ended),
            "errors": sum(o.result != "complete" for o in ended),
        }
        for kind, streamed in (("stream", True), ("plain", False)):
            seconds = [o.seconds for o in ended if o.job.stream == streamed and o.result == "complete"]
            row[f"{kind}_p50_s"] = percentile(seconds, 0.50)
            row[f"{kind}_p99_s"] = percentile(seconds, 0.99)
        for name in ("gateway", "worker"):
            values = [float(s[f"{name}_rss_mib"]) for s in in_minute]
            row[f"{name}_rss_mib_median"] = statistics.median(values) if values else None
            row[f"{name}_rss_mib_max"] = max(values) if values else None
        row["loadavg_end"] = in_minute[-1]["loadavg"] if in_minute else None
        rows.append(row)
    return rows


def verdicts(rows: list[dict], outcomes: list, args: argparse.Namespace) -> dict[str, object]:
    measured = rows[args.warmup_minutes :]
    if len(measured) < 2:
        raise SystemExit("need at least two minutes after the warm-up to judge growth and stability")
    result: dict[str, object] = {}
    for name in ("gateway", "worker"):
        base, end = measured[0][f"{name}_rss_mib_median"], measured[-1][f"{name}_rss_mib_median"]
        growth = (end - base) / base
        result[f"{name}_rss_growth"] = round(growth, 4)
        result[f"{name}_rss_ok"] = growth < args.max_growth
    errors = [o for o in outcomes if o.result != "complete"]
    result["errors"] = len(errors)
    result["error_kinds"] = sorted({f"{o.result}:{o.code}" for o in errors})
    result["errors_ok"] = not errors
    half = len(measured) // 2
    for kind in ("stream", "plain"):
        early = [r[f"{kind}_p99_s"] for r in measured[:half] if r[f"{kind}_p99_s"] is not None]
        late = [r[f"{kind}_p99_s"] for r in measured[half:] if r[f"{kind}_p99_s"] is not None]
        drift = statistics.mean(late) / statistics.mean(early)
        result[f"{kind}_p99_drift"] = round(drift, 3)
        result[f"{kind}_p99_ok"] = drift <= args.max_p99_drift
    result["all_ok"] = all(value for key, value in result.items() if key.endswith("_ok"))
    return result


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: the bundled baseline, exported once)")
    parser.add_argument("--minutes", type=int, default=10)
    parser.add_argument("--warmup-minutes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=32, help="max_tokens of streamed requests")
    parser.add_argument("--plain-tokens", type=int, default=16, help="max_tokens of non-streamed requests")
    parser.add_argument("--threads", type=int, default=1, help="the worker's torch threads")
    parser.add_argument("--sample-seconds", type=float, default=5.0)
    parser.add_argument("--max-growth", type=float, default=0.05)
    parser.add_argument("--max-p99-drift", type=float, default=1.25)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    if args.minutes - args.warmup_minutes < 2:
        parser.error("--minutes must leave at least two minutes after --warmup-minutes")
    if args.model is None:
        from squeezeserve.service.models.bundled import export_baseline

        args.model = str(export_baseline().path)

    commit = _commit()  # the code that runs: read before the run, not after it
    cpu_model, flags = _cpu_info()
    machine = {
        "cpu_model": cpu_model,
        "cpu_flags": " ".join(f for f in flags.split() if f.startswith(("avx2", "avx512", "amx"))),
        "cores": os.cpu_count(),
        "loadavg_start": _loadavg(),
        "shared": "2-core development machine shared with other engineers' builds and tests",
    }
    gateway, worker, gateway_process = start_servers(args.model, args.threads)
    try:
        pids = {"gateway": gateway_process.pid, "worker": worker.pid}
        outcomes, samples, started = asyncio.run(soak(gateway, pids, args))
    finally:
        stop_process(gateway_process)
        stop_process(worker)
    machine["loadavg_end"] = _loadavg()
    rows = per_minute(outcomes, samples, started, args.minutes)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "command": " ".join(["python", "tests/benchmarks/soak.py", *sys.argv[1:]]),
        "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "machine": machine,
        "requests": len(outcomes),
        "minutes": rows,
        "verdicts": verdicts(rows, outcomes, args),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for row in rows:
        print(json.dumps(row))
    print(json.dumps(result["verdicts"], indent=1))
    sys.exit(0 if result["verdicts"]["all_ok"] else 1)


if __name__ == "__main__":
    main()
