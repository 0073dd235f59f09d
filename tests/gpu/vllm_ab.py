"""Run 3: vLLM with squeezeserve's SiluAndMul / RMSNorm on or off -- throughput, greedy outputs, and proof.

One configuration per process (the plugin reads its switches when vLLM loads it), compiled with CUDA
graphs (vLLM's default), engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that
``torch.profiler`` sees the GPU kernels the engine launches and ``vllm_ops.call_counts()`` the Python-level
calls of our replacements. Writes a JSON record:

    {"label", "features", "greedy": [[token ids] per prompt], "throughput_tok_s", "kernels": {name: n},
     "ours_launched": {op: n}, "ours_launched_by_kernel": {kernel: n}, "call_counts": {...}, "pid",
     "versions"}

    SQUEEZESERVE_VLLM_RMS_NORM=0 SQUEEZESERVE_VLLM_SILU_AND_MUL=0 python3 tests/gpu/vllm_ab.py \
        --model /tmp/model/hf --label off --out off.json
    python3 tests/gpu/vllm_ab.py --compare off.json on.json     # identical greedy + throughput ratio
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import sys
import time

from squeezeserve.service.worker.vllm_plugin import compile_cache_root  # no torch, no vLLM at import

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM's compile cache key ignores our switches: without its own cache, "off" could load "on"'s graph.
os.environ["VLLM_CACHE_ROOT"] = compile_cache_root()

# Triton kernel names of our ops (kernels/ops/swiglu.py, rmsnorm.py, quant_matmul.py), matched exactly:
# quant_matmul launches one of its kernels by row count (FMA for one row -- the int4 one on word pairs --,
# tensor cores up to 64 rows, dequantize + cuBLAS above), so which of them ran shows the engine's path.
OUR_KERNELS = {
    "silu_and_mul": ("_swiglu_fwd",),
    "rms_norm": ("_rmsnorm_fwd",),
    "quant_matmul": ("_gemv_int4_kernel", "_skinny_kernel", "_dequantize_kernel"),
}
PROMPTS = [
    "The capital of France is",
    "Write one sentence about the sea:",
    "def fibonacci(n):",
    "Three primary colours are",
    "The theory of relativity says that",
    "A good breakfast contains",
    "Translate to French: good morning",
    "List three prime numbers:",
]


def run(args: argparse.Namespace) -> dict:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    from squeezeserve.kernels import vllm_ops
    from squeezeserve.service.worker.vllm_plugin import enabled_features

    extra = {"quantization": args.quantization} if args.quantization else {}
    if args.graphs:  # synth's configuration (run_h100.sh): no torch.compile, full CUDA graphs of decode steps
        extra["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    start = time.perf_counter()
    llm = LLM(
        model=args.model, dtype=args.dtype, gpu_memory_utilization=args.gpu_mem, max_model_len=2048,
        seed=0, enforce_eager=args.eager, **extra,
    )  # fmt: skip
    startup_s = time.perf_counter() - start
    greedy = SamplingParams(temperature=0.0, max_tokens=args.greedy_tokens)
    outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    texts = [o.outputs[0].text for o in outputs]
    # Throughput: a batch of distinct prompts, fixed output length.
    batch = [f"{PROMPTS[i % len(PROMPTS)]} (case {i})" for i in range(args.batch)]
    fixed = SamplingParams(temperature=0.0, max_tokens=args.batch_tokens, ignore_eos=True)
    llm.generate(batch[:8], fixed, use_tqdm=False)  # warm-up
    rates = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        outs = llm.generate(batch, fixed, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
    # Proof from the GPU side: kernels launched while serving one batch, by name. The long prompt's prefill
    # is wider than the largest CUDA graph, so its kernels launch outside any graph replay.
    long_prompt = " ".join(PROMPTS) * 24
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate([long_prompt], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        llm.generate(
            batch[:16], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
        )
    kernels: collections.Counter[str] = collections.Counter()
    kernel_us: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += 1
            kernel_us[event.name] += event.time_range.elapsed_us()
    ours = {op: sum(kernels[name] for name in names) for op, names in OUR_KERNELS.items()}
    ours_by_kernel = {name: kernels[name] for names in OUR_KERNELS.values() for name in names}
    return {
        "label": args.label,
        "model": args.model,
        "pid": os.getpid(),
        "features": enabled_features(),
        "quantization": args.quantization,
        "eager": args.eager,
        "startup_s": startup_s,
        "greedy": tokens,
        "texts": texts,
        "throughput_tok_s": sorted(rates)[len(rates) // 2],
        "throughput_runs": rates,
        "ours_launched": ours,
        "ours_launched_by_kernel": ours_by_kernel,
        "call_counts": vllm_ops.call_counts(),
        "top_kernels": dict(kernels.most_common(25)),
        "top_kernel_us": {k: round(v, 1) for k, v in kernel_us.most_common(25)},
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(),
        },
    }


CSV_FIELDS = [
    "run", "label", "reference", "model", "quantization", "throughput_tok_s", "throughput_runs",
    "ratio_vs_reference", "greedy_identical", "greedy_prompts", "first_divergence", "ours_launched",
    "device", "versions", "date",
]  # fmt: skip


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token of two greedy outputs, None when identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(paths: list[str], csv_path: str | None = None) -> int:
    records = [json.load(open(p)) for p in paths]
    base = records[0]
    rows = []
    for rec in records:
        same = sum(a == b for a, b in zip(rec["greedy"], base["greedy"], strict=True))
        ratio = rec["throughput_tok_s"] / base["throughput_tok_s"]
        diverge = [first_divergence(a, b) for a, b in zip(rec["greedy"], base["greedy"], strict=True)]
        print(
            f"{rec['label']:>10}: {rec['throughput_tok_s']:8.0f} tok/s ({ratio:.3f}x {base['label']}), "
            f"greedy identical {same}/{len(base['greedy'])} (first differing token per prompt: {diverge}), "
            f"our kernels launched {rec['ours_launched']}"
        )
        versions = rec["versions"]
        run = "quant-method-ab" if any(r.get("quantization") for r in records) else "run3-ops-ab"
        rows.append({
            "run": run, "label": rec["label"], "reference": base["label"], "model": rec.get("model", ""),
            "quantization": rec.get("quantization") or "",
            "throughput_tok_s": f"{rec['throughput_tok_s']:.0f}",
            "throughput_runs": " ".join(f"{r:.0f}" for r in rec["throughput_runs"]),
            "ratio_vs_reference": f"{ratio:.3f}", "greedy_identical": same,
            "greedy_prompts": len(base["greedy"]),
            "first_divergence": " ".join("-" if d is None else str(d) for d in diverge),
            "ours_launched": " ".join(f"{k}={v}" for k, v in rec["ours_launched"].items()),
            "device": versions["gpu"], "versions": f"vllm {versions['vllm']}; torch {versions['torch']}",
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
        })  # fmt: skip
    if csv_path:
        new = not os.path.exists(csv_path)
        with open(csv_path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            if new:
                writer.writeheader()
            writer.writerows(rows)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model")
    parser.add_argument("--label", default="run")
    parser.add_argument("--out")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--graphs", action="store_true", help="no torch.compile, full graphs of decode steps")
    parser.add_argument("--gpu-mem", type=float, default=0.3)
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare", nargs="+", help="JSON records to compare (first is the reference)")
    parser.add_argument("--csv", help="with --compare: append one row per record to this CSV")
    args = parser.parse_args()
    if args.compare:
        return compare(args.compare, args.csv)
    if not (args.model and args.out):
        parser.error("--model and --out are required unless --compare is given")
    record = run(args)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    keys = ("label", "throughput_tok_s", "ours_launched", "ours_launched_by_kernel", "call_counts")
    print(json.dumps({k: record[k] for k in keys}))
    print("greedy[0]:", repr(record["texts"][0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
