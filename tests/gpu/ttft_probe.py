"""Device probe for issue #16 item 3: where a W4A16 server's time to first token goes.

``run_h100.sh synth`` measures TTFT through HTTP (gateway, API server, engine), 8 requests a server. This
probe takes the HTTP away: one process per configuration builds vLLM's engine in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so torch's profiler sees the engine core's own step) with synth's
settings. The configurations (``--peers``, in order) load side by side, wait until all have loaded, then take
turns (one at a time, the others idle):

1. ``--rounds`` turns each of ``--repeats`` one-token generations of distinct random ``--prompt-tokens``
   prompts (prefill plus the first sample; distinct, so the prefix cache hits nothing): median, quartiles;
2. one more turn of ``--profile`` generations under ``torch.profiler``, and the trace read back. Per call:
   the wall time, the GPU's busy time (union of kernel intervals), kernel time by kernel, and the GPU's
   idle gaps, each with what the host was doing (the CPU op that launched the next kernel, and how long
   before its start). A GPU idle while the host works is host time on the critical path; a GPU busy
   throughout is kernel time. The profiler adds host time to every torch op it records, so a path of many
   ops (vLLM's Machete, cuBLAS through aten) slows under it more than one of few (launch plans);
3. one more turn of ``--repeats`` generations with the host time of the model's forward and of each linear
   layer's forward taken by wrappers (``time.perf_counter`` around the call, no sync: the time to enqueue).
   Against the wall time and the GPU's time this tells a host-bound step from a GPU-bound one.

``--compiled`` builds the engine in vLLM's compiled configuration instead (``COMPILED``), where a 256-token
prompt replays CUDA graphs between its attention calls; no anatomy turn then.

``--burst N``: each generation is N distinct prompts at once, the way ``bench_serving.py``'s requests reach a
server at concurrency N (its requests all ask for the same number of tokens, so they start, and later end,
together): the engine runs them in prompt steps of ``--max-batched-tokens`` rows (8192, ``vllm serve``'s
default on an 80 GB GPU; 64 prompts of 256 tokens are two such steps). The wall time of one is what the
last of N requests waits for its first token; the profile's kernels are those of steps at prefill sizes,
outside the CUDA graphs (the compiled configuration captures up to 256 tokens).

``--old-host-path`` serves our method as the code did before 2026-11-25's launch plans: every call through
torch's dispatcher (``quant_matmul_opaque``) and the launches prepared each call (set
``SQUEEZESERVE_LAUNCH_PLANS=0`` beside it).

    python3 tests/gpu/ttft_probe.py --model DIR --label NAME --peers A,B,.. --out DIR \\
        [--quantization squeezeserve] [--old-host-path] [--compiled]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
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


def read_trace(path: Path, gap_us: float, top: int = 14) -> list[str]:
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
        for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
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


# vLLM's default compiled configuration (torch.compile, piecewise CUDA graphs for mixed and prompt steps, full
# ones for decode), with capture sizes reaching the probe's 256-token prompt: vLLM's default stops at twice
# max_num_seqs (128 here), and its default max_num_seqs (256) would capture up to 512.
COMPILED = {
    "mode": 3,
    "cudagraph_mode": "FULL_AND_PIECEWISE",
    "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256],
}
HOST: dict[str, list[float]] = defaultdict(list)  # what -> host seconds a call (the anatomy turn)


def _timed(what: str, forward):
    def run(*args, **kwargs):
        t = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            HOST[what].append(time.perf_counter() - t)

    return run


def instrument(model) -> int:
    """Wrap the model's forward and each linear layer's (qkv_proj, o_proj, gate_up_proj, down_proj) in
    host timers (for ``LLM.apply_model``: runs in this process, the engine being in-process)."""
    n = 0
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Linear") and hasattr(module, "quant_method"):
            module.forward = _timed(name.rsplit(".", 1)[-1], module.forward)
            n += 1
    model.forward = _timed("model forward", model.forward)
    return n


def anatomy(walls: list[float]) -> list[str]:
    """Summary lines of the anatomy turn (``walls``: its generations' wall times, ms)."""
    calls = len(walls)
    forward = sorted(HOST["model forward"])
    lines = [
        f"anatomy ({calls} generations, host timers on): wall median {statistics.median(walls):.2f} ms; "
        f"model forward's host time median {statistics.median(forward) * 1e3:.2f} ms "
        f"({len(forward)} forwards); linear layers' host time a generation "
        f"{sum(sum(v) for k, v in HOST.items() if k != 'model forward') * 1e3 / calls:.2f} ms"
    ]
    for what, times in sorted(HOST.items()):
        if what != "model forward":
            median = statistics.median(times) * 1e6
            lines.append(f"  {what}: {len(times) // calls} calls a generation, host median {median:.1f} us")
    return lines


class Turns:
    """Processes of one probe taking turns through files in ``folder``: ``wait_all`` until every peer has
    arrived, then ``mine()`` (a context manager) runs while the shared counter names this peer."""

    def __init__(self, folder: Path, peers: list[str], me: str) -> None:
        self.folder, self.peers, self.index = folder, peers, peers.index(me)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.turn = 0

    def wait_all(self, timeout_s: float = 600) -> None:
        (self.folder / f"ready-{self.peers[self.index]}").touch()
        self._until(lambda: all((self.folder / f"ready-{p}").exists() for p in self.peers), timeout_s)

    def _until(self, done, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"peers {self.peers} did not arrive in {timeout_s} s")
            time.sleep(0.005)

    def _counter(self) -> int:
        try:
            return int((self.folder / "turn").read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    @contextmanager
    def mine(self, timeout_s: float = 300):
        target = self.turn * len(self.peers) + self.index
        self._until(lambda: self._counter() == target, timeout_s)
        try:
            yield
        finally:
            tmp = self.folder / f"turn.{self.peers[self.index]}"
            tmp.write_text(str(target + 1))
            tmp.replace(self.folder / "turn")
            self.turn += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--label", required=True)
    parser.add_argument("--peers", required=True, help="every configuration's label, in turn order")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--old-host-path", action="store_true")
    parser.add_argument("--compiled", action="store_true", help="vLLM's compiled mode (see COMPILED)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tag", default="", help="appended to the output files' names")
    parser.add_argument("--sync-dir", type=Path, default=Path("/tmp/ttft_probe.sync"))
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--profile", type=int, default=3)
    parser.add_argument("--gap-us", type=float, default=50.0)
    parser.add_argument("--burst", type=int, default=1, help="prompts a generation, submitted together")
    parser.add_argument("--max-batched-tokens", type=int, default=8192, help="with --burst: a step's rows")
    args = parser.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    if args.old_host_path:
        from squeezeserve.kernels import vllm_ops

        vllm_ops.eager = lambda *tensors: False  # quant_linear takes torch.ops' opaque op on every call

    llm = LLM(
        model=args.model,
        quantization=args.quantization,
        dtype="bfloat16",
        load_format="dummy",
        max_model_len=1024,
        max_num_seqs=64,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=4 << 30,
        compilation_config=COMPILED if args.compiled else {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
        **({"max_num_batched_tokens": args.max_batched_tokens} if args.burst > 1 else {}),
    )
    rng = random.Random(args.label)
    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)

    def one(tag: str | None = None) -> float:
        prompt = [
            {"prompt_token_ids": [rng.randrange(100, args.vocab) for _ in range(args.prompt_tokens)]}
            for _ in range(args.burst)
        ]
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
    turns = Turns(args.sync_dir, args.peers.split(","), args.label)
    turns.wait_all()
    times = []
    for _ in range(args.rounds):
        with turns.mine():
            times += [one() for _ in range(args.repeats)]
    times.sort()
    q = statistics.quantiles(times, n=4)
    what = f"{args.prompt_tokens}-token prompts" + (f", {args.burst} at once" if args.burst > 1 else "")
    head = (
        f"{args.label}: {len(times)} one-token generations of {what} "
        f"({args.rounds} turns), in-process engine: median {q[1]:.2f} ms (quartiles {q[0]:.2f}-{q[2]:.2f}, "
        f"min {times[0]:.2f})"
    )
    print(head, flush=True)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with turns.mine(), torch.profiler.profile(activities=activities) as prof:
        profiled = [one(f"ttft/{i}") for i in range(args.profile)]
    if not args.compiled:  # (new forwards on compiled modules would break Dynamo's guards)
        layers = llm.apply_model(instrument)[0]
        HOST.clear()
        with turns.mine():
            walls = [one() for _ in range(args.repeats)]
    trace = args.out / f"trace-{args.label}{args.tag}.json"
    prof.export_chrome_trace(str(trace))
    lines = [head, f"profiled calls (ms, with the profiler on): {', '.join(f'{t:.2f}' for t in profiled)}"]
    if not args.compiled:
        lines += [f"{layers} linear layers timed"] + anatomy(walls)
    lines += read_trace(trace, args.gap_us, top=24 if args.burst > 1 else 14)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    lines += ["", "host ops by self CPU time (all profiled calls):", table]
    (args.out / f"ttft-{args.label}{args.tag}.txt").write_text("\n".join(lines) + "\n")
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        dst.write(src.read())
    trace.unlink()
    print("\n".join(lines[:40]), flush=True)


if __name__ == "__main__":
    main()
