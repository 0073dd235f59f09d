"""``squeezeserve worker``: serve one model over the OpenAI API.

``--engine local`` runs the embedded CPU engine in this process; ``--engine vllm`` replaces this process
with ``vllm serve`` (our plugin loads through its ``vllm.general_plugins`` entry point). The flags map
onto :class:`~squeezeserve.service.worker.settings.WorkerSettings`, where their defaults live.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pydantic import ValidationError

from squeezeserve.service import paths
from squeezeserve.service.models.loader import QUANTIZED_LINEAR_MODES
from squeezeserve.service.worker.settings import (
    WorkerSettings,
    add_engine_arguments,
    available_cores,
    engine_options,
)

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory or Hugging Face id")
    parser.add_argument(
        "--served-model-name", default=None, help="name clients use (default: the model dir's name)"
    )
    parser.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port to listen on (default 8001)")
    add_engine_arguments(parser)
    parser.add_argument(
        "--no-custom-ops", action="store_true", help="local: run the model on stock modules, not our ops"
    )
    parser.add_argument(
        "--quantized-linear",
        choices=QUANTIZED_LINEAR_MODES,
        default=None,
        help="local: quantized weights through quant_matmul (kernel) or expanded at load (dequantize); "
        "auto (default) = kernel on GPU, dequantize on CPU",
    )
    parser.add_argument(
        "vllm_args", nargs=argparse.REMAINDER, help="vllm: arguments after -- go to vllm serve"
    )


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    given = {
        "model": args.model,
        "served_model_name": args.served_model_name,
        "host": args.host,
        "port": args.port,
        "quantized_linear": args.quantized_linear,
        **engine_options(args),
    }
    given = {name: value for name, value in given.items() if value is not None}
    return WorkerSettings(use_custom_ops=not args.no_custom_ops, **given)


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        problems = "; ".join(f"--{e['loc'][0]}: {e['msg']}".replace("_", "-") for e in exc.errors())
        print(f"error: invalid worker settings: {problems}", file=sys.stderr)
        return 2
    extra = [a for a in args.vllm_args if a != "--"]
    if settings.engine == "vllm":
        from squeezeserve.service.worker.launch import exec_vllm

        return exec_vllm(
            settings.model, settings.served_name, settings.host, settings.port, settings.dtype, extra
        )
    if extra:
        print(f"error: extra arguments are for --engine vllm only: {' '.join(extra)}", file=sys.stderr)
        return 2
    return serve_local(settings)


def serve_local(settings: WorkerSettings) -> int:
    if settings.compile == "on":
        paths.keep_compile_cache_in_home()  # before the imports below import our kernels (its docstring)
    import torch

    from squeezeserve.service.models.loader import load_model
    from squeezeserve.service.serving import serve
    from squeezeserve.service.worker.local.app import create_app

    # The engine thread runs the model with settings.threads torch threads. This (main) thread stays at one:
    # had it run torch ops with a team of OpenMP threads, that team would stay alive beside the engine's,
    # libgomp then counts more threads than cores and stops spinning between parallel regions, and every
    # matmul of the engine pays a futex wake-up (a one-row bf16 3072x576 matmul: 176 µs instead of 59 µs
    # at 2 threads on 2 cores, as slow as one thread).
    torch.set_num_threads(1)
    cores = available_cores()
    log.info("torch threads: %d (this process may use %d cores)", settings.threads, cores)
    try:
        loaded = load_model(
            settings.model,
            dtype=settings.dtype,
            use_custom_ops=settings.use_custom_ops,
            quantized_linear=settings.quantized_linear,
        )
    except (OSError, ValueError) as exc:
        print(f"error: cannot load model {settings.model}: {exc}", file=sys.stderr)
        return 1
    try:
        app = create_app(loaded, settings)
    except ValueError as exc:  # a decoder that cannot run this model
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info("decoder: %s", app.state.service.decoder_name)
    log.info(
        "serving %s as %r on http://%s:%d", settings.model, settings.served_name, settings.host, settings.port
    )
    serve(
        app, "worker", settings.host, settings.port, grace_seconds=settings.grace_seconds, log_level="warning"
    )
    return 0
