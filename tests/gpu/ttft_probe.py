"""Device probe for issue #16 item 3: where a W4A16 server's time to first token goes.

``run_h100.sh synth`` measures TTFT through HTTP (gateway, API server, engine). This probe takes the HTTP
away: one process per configuration builds vLLM's engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
so torch's profiler sees the engine core's own step) with synth's settings, then, holding ``--lock`` (the
configurations load side by side and measure one at a time):

1. times ``--repeats`` one-token generations of distinct random ``--prompt-tokens`` prompts (prefill plus
   the first sample; distinct, so the prefix cache hits nothing), median and quartiles;
2. profiles ``--profile`` more under ``torch.profiler`` and reads the trace. Per call: the wall time, the
   GPU's busy time (union of kernel intervals), kernel time by kernel, and the GPU's idle gaps, each with
   what the host was doing then (the CPU op that launched the next kernel, and how long before its start).
   A GPU idle while the host works is host time on the critical path; a GPU busy throughout is kernel time.

    python3 tests/gpu/ttft_probe.py --model DIR --label NAME [--quantization squeezeserve] --out DIR
"""

from __future__ import annotations

import argparse
import fcntl
import gzip
import json
import os
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (overlapping kernels of two streams count once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def read_trace(path: Path, gap_us: float) -> list[str]:
    """Summary lines for each ``ttft/<i>`` range of a chrome trace torch.profiler exported."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    calls = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ttft/")]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    runtime = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    cpu_ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])

    def launched_at(kernel: dict) -> float:
        launch = runtime.get(kernel["args"].get("correlation"))
        return kernel["ts"] if launch is None else launch["ts"]

    def launcher(kernel: dict) -> str:
        """The innermost CPU op around the kernel's launch."""
        launch = runtime.get(kernel["args"].get("correlation"))
        if launch is None:
            return "?"
        t = launch["ts"]
        inner = [op for op in cpu_ops if op["ts"] <= t <= op["ts"] + op["dur"] and op["tid"] == launch["tid"]]
        return min(inner, key=lambda op: op["dur"])["name"] if inner else "(python)"

    lines = []
    for call in sorted(calls, key=lambda e: e["ts"]):
        t0, t1 = call["ts"], call["ts"] + call["dur"]
        mine = [k for k in kernels if t0 <= k["ts"] < t1]
        if not mine:
            lines.append(f"{call['name']}: no kernels in range")
            continue
        busy = busy_union([(k["ts"], k["ts"] + k["dur"]) for k in mine])
        by_name: dict[str, list[float]] = defaultdict(list)
        for k in mine:
            by_name[k["name"]].append(k["dur"])
        lines.append(
            f"{call['name']}: wall {call['dur'] / 1e3:.2f} ms; {len(mine)} kernels, "
            f"GPU busy {busy / 1e3:.2f} ms ({busy / call['dur']:.0%}); "
            f"first kernel at +{(mine[0]['ts'] - t0) / 1e3:.2f} ms, last ends "
            f"{(t1 - mine[-1]['ts'] - mine[-1]['dur']) / 1e3:.2f} ms before the call returns"
        )
        lines.append("  kernels by GPU time (ms total, calls, name):")
        for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:14]:
            lines.append(f"    {sum(durs) / 1e3:8.3f} {len(durs):5d}  {name[:110]}")
        gaps, end = [], mine[0]["ts"] + mine[0]["dur"]
        for k in mine[1:]:
            if k["ts"] - end > gap_us:
                gaps.append((k["ts"] - end, k))
            end = max(end, k["ts"] + k["dur"])
        idle = sum(g for g, _ in gaps)
        lines.append(
            f"  GPU idle between kernels: {len(gaps)} gaps over {gap_us:.0f} us, {idle / 1e3:.2f} ms in all; "
            "largest (gap ms, next kernel's launch lead ms, launched from, next kernel):"
        )
        for gap, k in sorted(gaps, key=lambda g: -g[0])[:12]:
            lead = (k["ts"] - launched_at(k)) / 1e3
            lines.append(f"    {gap / 1e3:7.3f} {lead:7.3f}  {launcher(k)[:50]:50s}  {k['name'][:60]}")
        leads = sorted(k["ts"] - launched_at(k) for k in mine)
        lines.append(
            f"  launch-to-start lead over all kernels: median {leads[len(leads) // 2]:.0f} us, "
            f"{sum(1 for v in leads if v < 20) / len(leads):.0%} under 20 us (the GPU waited on the launch)"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--label", required=True)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lock", default="/tmp/ttft_probe.lock")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--profile", type=int, default=3)
    parser.add_argument("--gap-us", type=float, default=50.0)
    args = parser.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        quantization=args.quantization,
        dtype="bfloat16",
        load_format="dummy",
        max_model_len=1024,
        max_num_seqs=64,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=4 << 30,
        compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
    )
    rng = random.Random(args.label)
    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)

    def one(tag: str | None = None) -> float:
        prompt = {"prompt_token_ids": [rng.randrange(100, args.vocab) for _ in range(args.prompt_tokens)]}
        t = time.perf_counter()
        if tag:
            with torch.profiler.record_function(tag):
                llm.generate(prompt, params, use_tqdm=False)
        else:
            llm.generate(prompt, params, use_tqdm=False)
        return (time.perf_counter() - t) * 1e3

    for _ in range(5):
        one()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.lock, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        times = sorted(one() for _ in range(args.repeats))
        q = statistics.quantiles(times, n=4)
        head = (
            f"{args.label}: {args.repeats} one-token generations of {args.prompt_tokens}-token prompts, "
            f"in-process engine: median {q[1]:.2f} ms (quartiles {q[0]:.2f}-{q[2]:.2f}, min {times[0]:.2f})"
        )
        print(head, flush=True)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            profiled = [one(f"ttft/{i}") for i in range(args.profile)]
        fcntl.flock(lock, fcntl.LOCK_UN)
    trace = args.out / f"trace-{args.label}.json"
    prof.export_chrome_trace(str(trace))
    lines = [head, f"profiled calls (ms, with the profiler on): {', '.join(f'{t:.2f}' for t in profiled)}"]
    lines += read_trace(trace, args.gap_us)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    lines += ["", "host ops by self CPU time (all profiled calls):", table]
    (args.out / f"ttft-{args.label}.txt").write_text("\n".join(lines) + "\n")
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        dst.write(src.read())
    trace.unlink()
    print("\n".join(lines[:40]), flush=True)


if __name__ == "__main__":
    main()
