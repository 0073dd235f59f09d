"""vLLM on the GPU serving issue 20's formats (codebooks, low-rank factors) through our plugin, as vLLM runs
them by default (torch.compile, CUDA graphs of the decode steps): the engine's greedy tokens and their
log-probabilities against the float32 model transformers builds from the same checkpoint (teacher-forced, as
tests/service/worker/test_vllm_cpu_engine.py checks vLLM's CPU backend), and how many launch plans the
codebook op recorded in the engine's process.

    python3 tests/gpu/vllm_formats_probe.py BASELINE_DIR [codebook,lowrank]

Each checkpoint is made first with ``squeezeserve compress`` from the baseline (k-means 4-bit codebooks per
output channel; whitened SVD at 0.9 of the decoder's parameters), calibrated on a few windows of the shipped
sample: seconds, worse models than the README's, the same formats. vLLM staged (../shared/device/README.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three primary colours are"]
TOKENS = 24
TOLERANCE = 0.05  # log-probability: the engine's fp16 over 30 layers against float32 (the CPU test's)


def compress(baseline: Path, kind: str, out: Path) -> None:
    command = [sys.executable, "-m", "squeezeserve.service.cli", "compress", "--model", str(baseline)]
    command += ["--method", kind, "--out", str(out), "--calibration", "sample:wikitext-2-calibration"]
    command += ["--calibration-samples", "8", "--calibration-seq-len", "256"]
    if kind == "lowrank":
        command += ["--algorithm", "svdllm", "--rank-ratio", "0.9"]
    else:
        command += ["--algorithm", "kmeans", "--bits", "4"]
    start = time.perf_counter()
    done = subprocess.run(command, timeout=300, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{kind}: compress failed:\n{done.stderr[-3000:]}")
    print(f"{kind}: compressed in {time.perf_counter() - start:.0f} s", flush=True)


def served(checkpoint: Path) -> tuple[list, set, int]:
    """Each prompt's (prompt ids, greedy tokens, their log-probabilities), our linear methods vLLM picked, and
    the codebook op's recorded plans, from an engine in this process."""
    from vllm import LLM, SamplingParams

    from squeezeserve.kernels.ops import codebook_matmul

    start = time.perf_counter()
    llm = LLM(model=str(checkpoint), max_model_len=512, gpu_memory_utilization=0.3, seed=0)
    print(f"{checkpoint.name}: engine up in {time.perf_counter() - start:.0f} s", flush=True)
    model = llm.apply_model(lambda model: model)[0]
    methods = {type(m.quant_method).__name__ for n, m in model.named_modules() if hasattr(m, "quant_method")}
    params = SamplingParams(max_tokens=TOKENS, temperature=0, logprobs=0)
    runs = []
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        tokens = list(out.outputs[0].token_ids)
        logprobs = [step[t].logprob for step, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        runs.append((list(out.prompt_token_ids), tokens, logprobs))
    plans = len(codebook_matmul.codebook_matmul_eager.plans.plans)
    del llm
    return runs, methods, plans


def teacher_forced(checkpoint: Path, runs: list) -> list[tuple[float, float]]:
    """Per prompt: how far below the float32 model's argmax the engine's tokens lie, at most, and the largest
    gap between the engine's log-probabilities and the float32 model's for them."""
    from squeezeserve.service.models.loader import load_model

    reference = load_model(checkpoint, dtype="float32", use_custom_ops=False).model
    gaps = []
    with torch.no_grad():
        for prompt_ids, tokens, logprobs in runs:
            logits = reference(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1 : -1]
            ref = logits.log_softmax(-1)
            chosen = ref[torch.arange(len(tokens)), tokens]
            below = (ref.max(-1).values - chosen).max().item()
            gaps.append((below, (torch.tensor(logprobs) - chosen).abs().max().item()))
    return gaps


def main() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its plans
    baseline = Path(sys.argv[1])
    kinds = sys.argv[2].split(",") if len(sys.argv) > 2 else ["codebook", "lowrank"]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    ok = True
    for kind in kinds:
        checkpoint = Path(tempfile.mkdtemp()) / kind
        compress(baseline, kind, checkpoint)
        runs, methods, plans = served(checkpoint)
        gaps = teacher_forced(checkpoint, runs)
        good = all(below <= TOLERANCE and gap <= TOLERANCE for below, gap in gaps)
        ok &= good
        recorded = f"; codebook plans recorded {plans}" if kind == "codebook" else ""
        print(f"{kind}: methods {sorted(methods)}{recorded}", flush=True)
        for (prompt_ids, tokens, _), (below, gap) in zip(runs, gaps, strict=True):
            print(f"  {len(prompt_ids)} prompt tokens, {len(tokens)} generated: below the float32 argmax "
                  f"{below:.4f}, log-probability gap {gap:.4f}", flush=True)  # fmt: skip
        print(f"{kind}: {'agrees' if good else 'DISAGREES'} (tolerance {TOLERANCE})", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
