"""``squeezeserve gateway``: run the gateway with uvicorn. Flags override ``--config FILE`` and the
``SQUEEZESERVE_GATEWAY_*`` environment (see ``config.py``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import typing
from pathlib import Path
from typing import Any

from squeezeserve.service.gateway.config import (
    DEFAULT_MAX_BODY_BYTES,
    ENV_PREFIX,
    GatewaySettings,
    RoutingName,
    SettingsError,
    build_settings,
)
from squeezeserve.service.serving import DEFAULT_GRACE_SECONDS

# Settings fields with a flag of the same name (``dest``); ``--config`` is the file they override.
SETTINGS_FLAGS = (
    "upstreams",
    "host",
    "port",
    "routing",
    "affinity_prefix_chars",
    "affinity_load_factor",
    "api_keys",
    "requests_per_minute",
    "tokens_per_minute",
    "api_keys_file",
    "upstream_api_key",
    "request_timeout",
    "connect_timeout",
    "health_interval",
    "health_timeout",
    "unhealthy_threshold",
    "max_inflight_per_upstream",
    "max_body_bytes",
    "retry_after_seconds",
    "grace_seconds",
    "workers",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--upstream",
        dest="upstreams",
        action="append",
        metavar="URL",
        help="a worker's base URL (repeatable)",
    )
    parser.add_argument(
        "--config", type=Path, metavar="FILE", help="YAML file with settings (field names as keys)"
    )
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8000)")
    parser.add_argument(
        "--routing",
        choices=typing.get_args(RoutingName),
        help="load balancing (default least_outstanding); a request may override it with the "
        "X-Squeezeserve-Routing header",
    )
    parser.add_argument(
        "--affinity-prefix-chars",
        type=int,
        metavar="N",
        help="prefix_affinity: prompt characters that form the key (default 256)",
    )
    parser.add_argument(
        "--affinity-load-factor",
        type=float,
        metavar="F",
        help="prefix_affinity: an upstream takes at most (1 + F) x the mean load (default 0.25)",
    )
    parser.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        metavar="KEY",
        help="accept this key (repeatable; off if none)",
    )
    parser.add_argument(
        "--requests-per-minute",
        type=int,
        metavar="N",
        help="per API key, for keys without their own limit in --config (429 + Retry-After beyond it)",
    )
    parser.add_argument(
        "--tokens-per-minute",
        type=int,
        metavar="N",
        help="per API key, prompt + completion tokens as the upstream reports them (same rules)",
    )
    parser.add_argument(
        "--api-keys-file",
        type=Path,
        metavar="FILE",
        help="accept the keys in FILE too (comma- or newline-separated; e.g. a mounted secret)",
    )
    parser.add_argument("--upstream-api-key", metavar="KEY", help="Bearer key to send to the upstreams")
    parser.add_argument("--request-timeout", type=float, metavar="SECONDS", help="per request (default 600)")
    parser.add_argument("--connect-timeout", type=float, metavar="SECONDS", help="per connection (default 5)")
    parser.add_argument("--health-interval", type=float, metavar="SECONDS", help="between checks (default 5)")
    parser.add_argument("--health-timeout", type=float, metavar="SECONDS", help="per check (default 2)")
    parser.add_argument(
        "--unhealthy-threshold", type=int, metavar="N", help="failed checks to eject (default 3)"
    )
    parser.add_argument(
        "--max-inflight-per-upstream", type=int, metavar="N", help="beyond it, 429 Retry-After (default 64)"
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        metavar="N",
        help=f"larger request bodies get 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--retry-after-seconds", type=int, metavar="SECONDS", help="in 429 answers (default 1)"
    )
    parser.add_argument(
        "--grace-seconds",
        type=float,
        metavar="SECONDS",
        help="after SIGTERM / Ctrl-C: readiness and new requests answer 503 while the running ones get up "
        f"to this long to finish (default {DEFAULT_GRACE_SECONDS:g})",
    )
    parser.add_argument(
        "--workers", type=int, metavar="N", help="processes sharing the port; metrics aggregate (default 1)"
    )


def _export(settings: GatewaySettings) -> None:
    """Put ``settings`` in this process's environment, where the worker processes' ``get_settings()``
    reads them (lists as JSON; unset values removed)."""
    for name, value in settings.model_dump(mode="json").items():
        key = f"{ENV_PREFIX}{name.upper()}"
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = json.dumps(value) if isinstance(value, list) else str(value)


def _worker_log_config() -> dict[str, Any]:
    """The CLI's logging, for worker processes (they start afresh, without the CLI's setup)."""
    root = logging.getLogger()
    handler = next(iter(root.handlers), None)
    log_format = handler.formatter._fmt if handler and handler.formatter else None  # noqa: SLF001
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"cli": {"format": log_format or logging.BASIC_FORMAT}},
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "cli", "stream": "ext://sys.stderr"}
        },
        "root": {"level": logging.getLevelName(root.level), "handlers": ["stderr"]},
        "loggers": {
            name: {"level": logging.getLevelName(logging.getLogger(name).getEffectiveLevel())}
            for name in ("httpx", "httpcore")
        },
    }


def run(args: argparse.Namespace) -> int:
    import uvicorn

    try:
        settings = build_settings(args.config, **{name: getattr(args, name) for name in SETTINGS_FLAGS})
    except SettingsError as exc:
        sys.stderr.write(f"error: invalid gateway settings: {exc}\n")
        return 2
    if settings.workers > 1 and settings.has_rate_limits:
        logging.getLogger(__name__).warning(
            "each of the %d gateway processes keeps its own rate-limit buckets: a key may get up to %d "
            "times its limits",
            settings.workers,
            settings.workers,
        )
    # Our middleware logs one line per request (with model, status, latency, request id): uvicorn's own
    # access log would be a second one.
    server = {"host": settings.host, "port": settings.port, "access_log": False}
    if settings.workers == 1:
        from squeezeserve.service.gateway.app import create_app
        from squeezeserve.service.serving import serve

        serve(
            create_app(settings), "gateway", log_config=None, grace_seconds=settings.grace_seconds, **server
        )
        return 0
    # Several processes: each builds its app from the environment, and shares metrics through a directory
    # (the operator's PROMETHEUS_MULTIPROC_DIR, else a fresh one removed at exit).
    _export(settings)
    own_dir = (
        None
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        else tempfile.mkdtemp(prefix="squeezeserve-metrics-")
    )
    if own_dir:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = own_dir
    try:
        uvicorn.run(
            "squeezeserve.service.gateway.app:create_app",
            factory=True,
            workers=settings.workers,
            log_config=_worker_log_config(),
            **server,
        )
    finally:
        if own_dir:
            shutil.rmtree(own_dir, ignore_errors=True)
    return 0
