"""Device helper for issue #16 item 3: a vLLM server's engine steps, read from its torch profiler trace.

``run_h100.sh serve-prof`` starts servers with ``--profiler-config`` (vLLM's torch profiler, its traces in a
folder a server) and profiles a ``bench_serving.py`` pass between ``/start_profile`` and ``/stop_profile``.
vLLM names each engine step's range ``execute_context_<requests>(<tokens>)_generation_<requests>(<tokens>)``.
This reads the trace back: each step's kernels (those whose launch, or CUDA graph launch, falls inside the
step's range), their GPU time and span; then steps grouped by their rows (prompt plus decode tokens), and
the kernels of the steps that carry prompt tokens by total time, and those of the decode-only steps, a step's
share of each. Kernel times are the GPU's own; the host times carry the profiler's overhead.

    python3 tests/gpu/serve_trace.py TRACE_DIR --label NAME [--top 24] [--by-size 8]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from bisect import bisect_left, bisect_right
from collections import defaultdict
from pathlib import Path

STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
BUCKETS = [(1, 64), (65, 512), (513, 2048), (2049, 4096), (4097, 8192)]


def load(folder: Path) -> list[dict]:
    """The events of the newest engine trace in ``folder`` (vLLM writes ``*.pt.trace.json[.gz]``)."""
    traces = sorted(folder.rglob("*.pt.trace.json*"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise SystemExit(f"no torch profiler trace under {folder}")
    path = traces[-1]
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def steps_of(events: list[dict]) -> list[dict]:
    """One dict a step: rows, prompt rows, host range (us) and its kernels' intervals."""
    launches = sorted(
        (e["ts"], e["tid"], e["args"]["correlation"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    )
    launch_ts = [t for t, _, _ in launches]
    kernels: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel" and "correlation" in e.get("args", {}):
            kernels[e["args"]["correlation"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    steps = []
    for e in events:
        m = STEP.fullmatch(e.get("name", "")) if e.get("cat") == "user_annotation" else None
        if not m:
            continue
        t0, t1 = e["ts"], e["ts"] + e["dur"]
        mine = []
        for i in range(bisect_left(launch_ts, t0), bisect_right(launch_ts, t1)):
            if launches[i][1] == e["tid"]:
                mine += kernels.get(launches[i][2], [])
        ctx, gen = int(m[2]), int(m[4])
        steps.append({"rows": ctx + gen, "prompt": ctx, "t0": t0, "host": e["dur"], "kernels": mine})
    return sorted(steps, key=lambda s: s["t0"])


def busy(intervals: list[tuple[float, float, str]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e, _ in sorted(intervals):
        if s >= end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def extent(intervals: list[tuple[float, float, str]]) -> float:
    """From the first kernel's start to the last one's end."""
    return max(k[1] for k in intervals) - min(k[0] for k in intervals)


def kernel_table(steps: list[dict], top: int, per_step: bool = False) -> list[str]:
    """The steps' kernels by total time: ms, calls and name (``per_step``: us and calls a step)."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for s in steps:
        for start, end, name in s["kernels"]:
            by_name[name].append(end - start)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    if per_step:
        return [f"    {sum(d) / len(steps):9.2f} {len(d) / len(steps):6.1f}  {n[:110]}" for n, d in ranked]
    return [f"    {sum(d) / 1e3:9.3f} {len(d):6d}  {n[:110]}" for n, d in ranked]


def report(steps: list[dict], label: str, top: int, by_size: int = 0) -> list[str]:
    lines = [f"{label}: {len(steps)} engine steps profiled"]
    lines.append("  rows       steps  prompt rows  GPU busy ms (sum)  busy/step ms  host/step ms  span/step")
    for lo, hi in BUCKETS:
        group = [s for s in steps if lo <= s["rows"] <= hi]
        if not group:
            continue
        gpu = [busy(s["kernels"]) / 1e3 for s in group]
        span = [extent(s["kernels"]) / 1e3 for s in group if s["kernels"]]
        lines.append(
            f"  {lo:>4}-{hi:<5} {len(group):6d} {sum(s['prompt'] for s in group):12d} {sum(gpu):18.2f} "
            f"{sum(gpu) / len(group):13.3f} {sum(s['host'] for s in group) / len(group) / 1e3:13.3f} "
            f"{sum(span) / max(len(span), 1):13.3f}"
        )
    prompt_steps = [s for s in steps if s["prompt"]]
    total = sum(k[1] - k[0] for s in prompt_steps for k in s["kernels"])
    lines.append(
        f"  steps with prompt tokens: {len(prompt_steps)}, {sum(s['rows'] for s in prompt_steps)} rows, "
        f"kernels {total / 1e3:.2f} ms; by kernel (ms, calls, name):"
    )
    lines += kernel_table(prompt_steps, top)
    for lo, hi in BUCKETS if by_size else ():  # (where a size's prompt steps spend their GPU time)
        group = [s for s in prompt_steps if lo <= s["rows"] <= hi]
        if group:
            counts = ", ".join(str(s["rows"]) for s in sorted(group, key=lambda s: s["rows"])[:32])
            lines.append(
                f"  prompt steps of {lo}-{hi} rows: {len(group)} ({counts}); by kernel (ms, calls, name):"
            )
            lines += kernel_table(group, by_size)
    decode = [s for s in steps if not s["prompt"] and s["kernels"]]
    if decode:  # (the c=1 question: a decode step's GPU time, kernel by kernel, inside its CUDA graph)
        rows = sum(s["rows"] for s in decode) / len(decode)
        gpu = sum(busy(s["kernels"]) for s in decode) / len(decode)
        lines.append(
            f"  decode-only steps: {len(decode)}, {rows:.1f} rows, GPU busy {gpu:.1f} us a step; "
            "by kernel (us a step, calls a step, name):"
        )
        lines += kernel_table(decode, top, per_step=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--label", required=True)
    parser.add_argument("--top", type=int, default=24)
    parser.add_argument("--by-size", type=int, default=0, help="also each size's prompt steps' top N kernels")
    args = parser.parse_args()
    print("\n".join(report(steps_of(load(args.folder)), args.label, args.top, args.by_size)), flush=True)


if __name__ == "__main__":
    main()
