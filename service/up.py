"""``squeezeserve up``: the whole local stack in one command.

Prepares the bundled baseline if needed, starts one worker (a child process) and the gateway in front of
it (this process), prints where to send requests, and on Ctrl-C / SIGTERM stops both: the first Ctrl-C
drains the open requests, a second stops everything at once.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable

from pydantic import ValidationError

from squeezeserve.service.processes import stop_process, wait_until_healthy
from squeezeserve.service.worker.settings import WorkerSettings, add_engine_arguments, engine_options

log = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="gateway address")
    parser.add_argument("--port", type=int, default=8000, help="gateway port")
    parser.add_argument(
        "--worker-port", type=int, default=None, help="worker port (default: gateway port + 1)"
    )
    parser.add_argument(
        "--model", default=None, help="checkpoint dir or HF id (default: the bundled baseline)"
    )
    parser.add_argument("--served-model-name", default=None)
    add_engine_arguments(parser)
    parser.add_argument("--api-key", action="append", default=[], help="require this key at the gateway")


def _prepare_model(args: argparse.Namespace) -> tuple[str, str | None]:
    if args.model:
        return args.model, args.served_model_name
    from squeezeserve.service.models import bundled

    result = bundled.export_baseline()
    print(
        f"baseline: {'exported to' if result.created else 'using'} {result.path}"
        + (f" ({result.seconds:.0f}s)" if result.created else ""),
        flush=True,
    )
    return str(result.path), args.served_model_name or bundled.SERVED_NAME


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from squeezeserve.service.models.bundled import BundledModelMissing

    try:
        model, name = _prepare_model(args)
        worker_settings = WorkerSettings(
            model=model,
            served_model_name=name,
            host="127.0.0.1",
            port=args.worker_port or args.port + 1,
            **engine_options(args),
        )
    except BundledModelMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValidationError as exc:
        print(f"error: invalid worker settings: {exc}", file=sys.stderr)
        return 2
    worker_url = f"http://127.0.0.1:{worker_settings.port}"
    cmd = [sys.executable, "-m", "squeezeserve.service.cli", "--log-level", args.log_level, "worker"]
    worker = subprocess.Popen(cmd + worker_settings.flags(), start_new_session=True)  # Ctrl-C is ours
    # SIGTERM (docker stop, systemd) takes the same clean path as Ctrl-C. uvicorn re-raises the signal
    # once the gateway has shut down, which lands here.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        engine, name = worker_settings.engine, worker_settings.served_name
        print(f"starting worker ({engine}) for {name} on {worker_url} ...", flush=True)
        wait_until_healthy(worker_url, WORKER_START_TIMEOUT_S, worker)
        return _serve_gateway(args, worker_url, name, lambda: _kill_group(worker))
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        print("stopping worker ...", flush=True)
        stop_process(worker, grace=15)


def _kill_group(process: subprocess.Popen) -> None:
    """A second Ctrl-C: the worker (its own session) goes at once, with whatever it was generating."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)  # a second Ctrl-C exits once the worker is gone, not before


def _serve_gateway(
    args: argparse.Namespace, worker_url: str, name: str, on_force_exit: Callable[[], None]
) -> int:
    from squeezeserve.service.gateway.app import create_app
    from squeezeserve.service.gateway.config import GatewaySettings
    from squeezeserve.service.serving import serve

    settings = GatewaySettings(upstreams=[worker_url], host=args.host, port=args.port, api_keys=args.api_key)
    base = f"http://{args.host}:{args.port}"
    print(
        f"\nsqueezeserve is up: model {name!r} behind {base}/v1\n"
        f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{name}", "messages": [{{"role": "user", '
        f'"content": "What is the capital of France?"}}]}}\'\n'
        f"  metrics: {base}/metrics   (Ctrl-C drains and stops both; twice exits at once)\n",
        flush=True,
    )
    serve(
        create_app(settings),
        "gateway",
        args.host,
        args.port,
        on_force_exit,
        grace_seconds=args.grace_seconds,
        log_level="warning",
    )
    return 0
