"""``squeezeserve worker``: serve one model over the OpenAI API.

``--engine local`` runs the embedded CPU engine in this process; ``--engine vllm`` replaces this process
with ``vllm serve`` (our plugin loads through its ``vllm.general_plugins`` entry point).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

ENGINES = ("local", "vllm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine", choices=ENGINES, default="local", help="local: embedded CPU engine; vllm: vllm serve"
    )
    parser.add_argument("--model", required=True, help="checkpoint directory or Hugging Face id")
    parser.add_argument(
        "--served-model-name", default=None, help="name clients use (default: the model dir's name)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"])
    parser.add_argument("--max-batch-size", type=int, default=16, help="local: sequences decoded together")
    parser.add_argument("--max-waiting", type=int, default=256, help="local: queued requests before 429")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="local: torch CPU threads (default: the cores this process may use)",
    )
    parser.add_argument(
        "--no-custom-ops", action="store_true", help="local: run the model on stock modules, not our ops"
    )
    parser.add_argument(
        "--quantized-linear",
        choices=["auto", "kernel", "dequantize"],
        default="auto",
        help="local: quantized weights through quant_matmul (kernel) or expanded at load (dequantize); "
        "auto = kernel on GPU, dequantize on CPU",
    )
    parser.add_argument(
        "vllm_args", nargs=argparse.REMAINDER, help="vllm: arguments after -- go to vllm serve"
    )


def served_name(model: str, explicit: str | None) -> str:
    if explicit:
        return explicit
    path = Path(model)
    return path.name if path.exists() else model


def run(args: argparse.Namespace) -> int:
    name = served_name(args.model, args.served_model_name)
    extra = [a for a in args.vllm_args if a != "--"]
    if args.engine == "vllm":
        from squeezeserve.service.worker.launch import exec_vllm

        return exec_vllm(args.model, name, args.host, args.port, args.dtype, extra)
    if extra:
        print(f"error: extra arguments are for --engine vllm only: {' '.join(extra)}", file=sys.stderr)
        return 2
    if args.max_batch_size < 1:
        print("error: --max-batch-size must be at least 1", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print(f"error: --threads must be at least 1, got {args.threads}", file=sys.stderr)
        return 2
    return serve_local(
        args.model,
        name,
        args.host,
        args.port,
        args.dtype,
        args.max_batch_size,
        args.max_waiting,
        args.threads,
        not args.no_custom_ops,
        args.quantized_linear,
    )


def serve_local(
    model: str,
    name: str,
    host: str,
    port: int,
    dtype: str = "auto",
    max_batch_size: int = 16,
    max_waiting: int = 256,
    threads: int | None = None,
    use_custom_ops: bool = True,
    quantized_linear: str = "auto",
) -> int:
    import torch

    from squeezeserve.service.models.loader import load_model
    from squeezeserve.service.serving import serve
    from squeezeserve.service.worker.local.app import create_app

    usable = usable_cores()
    torch.set_num_threads(threads or usable)
    log.info("torch threads: %d (this process may use %d cores)", torch.get_num_threads(), usable)
    try:
        loaded = load_model(
            model, dtype=dtype, use_custom_ops=use_custom_ops, quantized_linear=quantized_linear
        )
    except (OSError, ValueError) as exc:
        print(f"error: cannot load model {model}: {exc}", file=sys.stderr)
        return 1
    app = create_app(loaded, name, max_batch_size=max_batch_size, max_waiting=max_waiting)
    log.info("serving %s as %r on http://%s:%d", model, name, host, port)
    serve(app, "worker", host, port, log_level="warning", timeout_graceful_shutdown=10)
    return 0


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's cpuset, taskset), not the
    machine's: torch's default of every core oversubscribes a worker pinned to a few."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
