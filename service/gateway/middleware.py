"""Per-request context, as plain ASGI (so streams pass through untouched): the request id and the
request metrics.

``X-Request-Id`` is taken from the client when it is sane (printable, at most 128 characters), else made
here; routes read it from ``request.state.request_id``, it goes upstream and comes back on every response.
For the OpenAI routes the middleware counts requests by route, model and status and times them to the
last byte; routes name the model in ``request.state.model`` once they know it. A request made with a key
that has limits gets the key's ``x-ratelimit-*`` headers on its response, whatever the status.
"""

from __future__ import annotations

import logging
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from squeezeserve.service.gateway.metrics import UNKNOWN_MODEL

log = logging.getLogger(__name__)

OPENAI_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models"})
_MAX_ID_LENGTH = 128


def _request_id(headers: Headers) -> str:
    given = headers.get("x-request-id", "")
    if 0 < len(given) <= _MAX_ID_LENGTH and given.isprintable() and given.isascii():
        return given
    return uuid.uuid4().hex


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = _request_id(Headers(scope=scope))
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status = 500  # if the app dies before starting a response, the server answers 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = MutableHeaders(scope=message)
                headers["x-request-id"] = request_id
                limits = state.get("rate_limits")  # set for a key with limits (deps.require_api_key)
                if limits is not None:
                    for name, value in limits.headers():
                        headers[name] = value
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = scope["path"]
            if route in OPENAI_ROUTES:
                elapsed = time.perf_counter() - started
                model = state.get("model", UNKNOWN_MODEL)
                metrics = scope["app"].state.metrics
                metrics.requests.labels(route, model, str(status)).inc()
                metrics.latency.labels(route, model).observe(elapsed)
                log.info(
                    "%s %s model=%s status=%d %.3fs id=%s",
                    scope["method"],
                    route,
                    model,
                    status,
                    elapsed,
                    request_id,
                )
