"""``squeezeserve validate``: candidate vs baseline on accuracy, latency and size; one report; gates.

Exit codes: 0 every gate passes (or none given), 1 a gate fails (report.md says which and by how much),
2 usage error (bad flag, unknown gate metric, unreadable dataset, unreachable endpoint) or a run that
could not finish.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from squeezeserve.service.models.loader import DTYPES
from squeezeserve.service.worker.settings import ENGINES

log = logging.getLogger(__name__)

API_KEY_ENV = "SQUEEZESERVE_API_KEY"
API_KEY_FILE_ENV = "SQUEEZESERVE_API_KEY_FILE"
EPILOG_HEAD = """\
models: a checkpoint directory (loaded here for accuracy; a worker is started for latency) or an
OpenAI-compatible endpoint as URL#MODEL, e.g. http://127.0.0.1:8000/v1#smollm2-135m-instruct.

gates: --gate "ppl_ratio<=1.03" --gate "top1_agreement>=0.9" --gate "tpot_p50_ratio<=0.8", or
--gates FILE.yaml (a list of such strings, or a mapping metric: "<=1.03"). Metric names:
"""


def _epilog() -> str:
    from squeezeserve.service.validate import metrics

    body = (metrics.__doc__ or "").split("\n", 2)[2].replace("``", "")
    return EPILOG_HEAD + body + "\n" + (__doc__ or "").split("\n\n", 1)[1]


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not levels or any(level < 1 for level in levels):
        raise argparse.ArgumentTypeError(f"concurrency levels must be integers >= 1, got {text!r}")
    return sorted(set(levels))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _epilog()
    parser.add_argument("--baseline", required=True, help="checkpoint dir or URL#MODEL")
    parser.add_argument("--candidate", required=True, help="checkpoint dir or URL#MODEL")
    parser.add_argument(
        "--dataset",
        required=True,
        help="UTF-8 text file, sample:wikitext-2-test (shipped), or hf:NAME[:CONFIG[:SPLIT]] online",
    )
    parser.add_argument("--out", default="validate-report", help="report directory (default: %(default)s)")
    parser.add_argument(
        "--gate", action="append", default=[], metavar="EXPR", help="NAME OP NUMBER; repeatable"
    )
    parser.add_argument("--gates", metavar="FILE", help="YAML file of gates (added to --gate)")
    parser.add_argument(
        "--api-key", default=os.environ.get(API_KEY_ENV), help=f"Bearer key for endpoints (env {API_KEY_ENV})"
    )
    parser.add_argument(
        "--api-key-file",
        type=Path,
        default=os.environ.get(API_KEY_FILE_ENV),
        metavar="FILE",
        help=f"send the first key in FILE when --api-key is not given, e.g. a mounted secret "
        f"(env {API_KEY_FILE_ENV})",
    )
    parser.add_argument("--tokenizer", help="tokenizer dir or id when both sides are endpoints")
    accuracy = parser.add_argument_group("accuracy")
    accuracy.add_argument("--window", type=_positive_int, default=512, help="tokens per window (default 512)")
    accuracy.add_argument("--stride", type=_positive_int, default=256, help="window start step (default 256)")
    accuracy.add_argument("--max-tokens", type=_positive_int, help="score only the dataset's first N tokens")
    accuracy.add_argument("--task", metavar="JSONL", help='multiple choice: {"context", "choices", "answer"}')
    accuracy.add_argument("--skip-accuracy", action="store_true")
    latency = parser.add_argument_group("latency")
    latency.add_argument(
        "--concurrency", type=_levels, default=[1, 4, 16, 64], help="levels, e.g. 1,4 (default 1,4,16,64)"
    )
    latency.add_argument(
        "--prompt-tokens", type=_positive_int, default=128, help="prompt length (default 128)"
    )
    latency.add_argument("--output-tokens", type=_positive_int, default=64, help="max_tokens (default 64)")
    latency.add_argument(
        "--requests-per-level", type=_positive_int, help="requests per level (default 4 x concurrency, >= 8)"
    )
    latency.add_argument("--duration-s", type=float, help="stop sending new requests in a level after this")
    latency.add_argument(
        "--warmup-requests", type=int, default=2, help="uncounted requests per level (default 2)"
    )
    latency.add_argument("--slo-ttft-ms", type=float, help="goodput SLO on time to first token")
    latency.add_argument("--slo-tpot-ms", type=float, help="goodput SLO on time per output token")
    latency.add_argument("--skip-latency", action="store_true")
    local = parser.add_argument_group("local checkpoints")
    local.add_argument("--engine", choices=ENGINES, default="local", help="worker for latency runs")
    local.add_argument("--dtype", default="auto", choices=DTYPES)
    local.add_argument("--device", default="cpu", help="device for local accuracy (cpu, cuda, cuda:1)")


def config_from_args(args: argparse.Namespace):  # -> job.JobConfig (import kept lazy)
    from squeezeserve.service.secrets import read_api_keys
    from squeezeserve.service.validate import gates
    from squeezeserve.service.validate.job import JobConfig
    from squeezeserve.service.validate.latency import LoadSettings
    from squeezeserve.service.validate.specs import UsageError, parse_spec

    if args.skip_accuracy and args.skip_latency:
        raise UsageError("--skip-accuracy and --skip-latency together leave nothing to validate")
    if args.duration_s is not None and args.duration_s <= 0:
        raise UsageError(f"--duration-s must be positive, got {args.duration_s}")
    if args.warmup_requests < 0:
        raise UsageError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    api_key = args.api_key
    if api_key is None and args.api_key_file is not None:
        try:
            api_key = next(iter(read_api_keys(args.api_key_file)), None)
        except ValueError as exc:
            raise UsageError(f"--api-key-file: {exc}") from exc
    gate_list = [gates.parse_gate(text) for text in args.gate]
    if args.gates:
        gate_list += gates.read_gates_file(args.gates)
    return JobConfig(
        baseline=parse_spec(args.baseline, "--baseline"),
        candidate=parse_spec(args.candidate, "--candidate"),
        dataset=args.dataset,
        out=Path(args.out),
        gates=gate_list,
        api_key=api_key,
        tokenizer=args.tokenizer,
        window=args.window,
        stride=args.stride,
        max_tokens=args.max_tokens,
        task=args.task,
        skip_accuracy=args.skip_accuracy,
        skip_latency=args.skip_latency,
        load=LoadSettings(
            concurrency=args.concurrency,
            requests_per_level=args.requests_per_level,
            duration_s=args.duration_s,
            output_tokens=args.output_tokens,
            warmup_requests=args.warmup_requests,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
        ),
        prompt_tokens=args.prompt_tokens,
        engine=args.engine,
        dtype=args.dtype,
        device=args.device,
    )


def run(args: argparse.Namespace) -> int:
    from squeezeserve.service.validate.job import Job
    from squeezeserve.service.validate.specs import UsageError

    try:
        report = Job(config_from_args(args)).run()
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as exc:
        print(f"error: the validation run could not finish: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    print(f"report: {out / 'report.md'} and {out / 'report.json'}")
    for gate in report["gates"]:
        verdict = "pass" if gate["passed"] else "FAIL"
        value = "not measured" if gate["value"] is None else f"{gate['value']:.6g}"
        print(f"  {verdict}  {gate['gate']}  (value {value})")
    return 0 if report["passed"] else 1
