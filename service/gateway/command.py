"""``squeezeserve gateway``: run the gateway with uvicorn. Flags override ``--config FILE`` and the
``SQUEEZESERVE_GATEWAY_*`` environment (see ``config.py``)."""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

from squeezeserve.service.gateway.config import RoutingName, SettingsError, build_settings

# Settings fields with a flag of the same name (``dest``); ``--config`` is the file they override.
SETTINGS_FLAGS = (
    "upstreams",
    "host",
    "port",
    "routing",
    "affinity_prefix_chars",
    "affinity_load_factor",
    "api_keys",
    "upstream_api_key",
    "request_timeout",
    "connect_timeout",
    "health_interval",
    "health_timeout",
    "unhealthy_threshold",
    "max_inflight_per_upstream",
    "retry_after_seconds",
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
        "--retry-after-seconds", type=int, metavar="SECONDS", help="in 429 answers (default 1)"
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from squeezeserve.service.gateway.app import create_app

    try:
        settings = build_settings(args.config, **{name: getattr(args, name) for name in SETTINGS_FLAGS})
    except SettingsError as exc:
        sys.stderr.write(f"error: invalid gateway settings: {exc}\n")
        return 2
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_config=None)
    return 0
