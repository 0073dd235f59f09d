"""Forward one validated OpenAI request to an upstream and relay its answer.

The request's deadline (``request_timeout``) covers choosing, connecting, waiting for the upstream's
headers and every later read; past it the client gets 504 (or, once a stream has started, an error event).
A connection error before the upstream answered is retried once on another healthy upstream (the same one
when it is the only candidate); nothing has reached the client at that point, so a retry is invisible.

Streams are relayed by an async generator: status and headers first, then each SSE event as soon as it is
complete, in its original bytes. Events are parsed only where the gateway needs their content: until the
first one with generated content (time to first token is taken there) and then only those that name a
``usage`` (token metrics). When the client goes away the upstream response is closed, which closes its
connection, so the worker stops generating.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from http import HTTPStatus
from typing import Any

import anyio
import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from squeezeserve.service.gateway import errors, sse
from squeezeserve.service.gateway.config import GatewaySettings
from squeezeserve.service.gateway.metrics import GatewayMetrics
from squeezeserve.service.gateway.routing import RouteRequest, RoutingStrategy
from squeezeserve.service.gateway.upstream_http import (
    UpstreamBroken,
    UpstreamPool,
    UpstreamResponse,
    UpstreamUnreachable,
)
from squeezeserve.service.gateway.upstreams import Upstream, UpstreamRegistry
from squeezeserve.service.protocol import error_body
from squeezeserve.service.serving import CLIENT_CLOSED_REQUEST, ClientGone, unless_gone

log = logging.getLogger(__name__)

# RFC 9110 7.6.1: meaningful for one connection only, never forwarded.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Also not forwarded upstream: recomputed (host, length), ours to set (request id, encoding), or the
# client's credentials for the gateway (the upstream gets ``upstream_api_key`` instead).
_NOT_SENT_UPSTREAM = HOP_BY_HOP | {
    "host",
    "content-length",
    "authorization",
    "accept-encoding",
    "x-request-id",
}
# Also not relayed back: recomputed by our server, or set by our middleware.
_NOT_RETURNED = HOP_BY_HOP | {"content-length", "content-encoding", "date", "server", "x-request-id"}


def strip_hop_by_hop(headers: Iterable[tuple[str, str]], drop: frozenset[str]) -> list[tuple[str, str]]:
    """``headers`` (name, value) pairs without ``drop`` and without the headers ``Connection`` names."""
    pairs = [(name.lower(), value) for name, value in headers]
    named = {h.strip().lower() for name, value in pairs if name == "connection" for h in value.split(",")}
    skip = drop | named if named else drop
    return [(name, value) for name, value in pairs if name not in skip]


class RelayResponse(StreamingResponse):
    """A streaming response that always runs ``on_close`` when it is done, even when the client left
    before the body started (then the body generator never runs, so its own cleanup would not either)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Any], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


class Proxy:
    def __init__(
        self,
        pool: UpstreamPool,
        upstreams: UpstreamRegistry,
        strategy: RoutingStrategy,
        metrics: GatewayMetrics,
        settings: GatewaySettings,
    ) -> None:
        self._pool = pool
        self._upstreams = upstreams
        self._strategy = strategy
        self._metrics = metrics
        self._settings = settings

    @property
    def max_body_bytes(self) -> int:
        return self._settings.max_body_bytes

    # -- choosing ----------------------------------------------------------------------------------

    async def _reserve(self, request: RouteRequest, failed: Upstream | None = None) -> Upstream:
        """Pick an upstream and count the request against its in-flight limit."""
        candidates = self._upstreams.candidates(request.model)
        if failed is not None:
            # Retry elsewhere; the failed one again only when there is nowhere else and it is not ejected
            # (a keep-alive connection it closed just as we reused it, rather than a dead or hung upstream).
            candidates = [u for u in candidates if u is not failed] or ([failed] if failed.healthy else [])
        if not candidates:
            if self._upstreams.is_known(request.model) or not self._upstreams.healthy():
                raise errors.no_healthy_upstream(request.model)
            raise errors.model_not_found(request.model)
        limit = self._settings.max_inflight_per_upstream
        available = [u for u in candidates if u.in_flight < limit]
        if not available:
            raise errors.overloaded(self._settings.retry_after_seconds)
        upstream = await self._strategy.select(available, request)
        if upstream.in_flight >= limit:  # a strategy that awaited may have lost the race for the last slot
            raise errors.overloaded(self._settings.retry_after_seconds)
        upstream.in_flight += 1
        self._metrics.in_flight_changed(upstream)
        return upstream

    def _elsewhere(self, request: RouteRequest, upstream: Upstream) -> bool:
        """Whether another healthy upstream serves ``request``'s model."""
        return any(u is not upstream for u in self._upstreams.candidates(request.model))

    def _release(self, upstream: Upstream) -> None:
        upstream.in_flight -= 1
        self._metrics.in_flight_changed(upstream)

    # -- sending -----------------------------------------------------------------------------------

    def _upstream_headers(
        self, request: RouteRequest, client_headers: Iterable[tuple[str, str]]
    ) -> list[tuple[str, str]]:
        headers = strip_hop_by_hop(client_headers, _NOT_SENT_UPSTREAM)
        headers.append(("x-request-id", request.request_id))
        # Identity encoding: chunks are relayed as they come, without re-compressing.
        headers.append(("accept-encoding", "identity"))
        if self._settings.upstream_api_key:
            headers.append(("authorization", f"Bearer {self._settings.upstream_api_key}"))
        return headers

    async def _send(
        self, request: RouteRequest, body: bytes, headers: list[tuple[str, str]], path: str
    ) -> tuple[UpstreamResponse, Upstream]:
        """Send to a reserved upstream; on a connection error retry once. Returns the response (headers
        read, body not) and the upstream it came from, still reserved."""
        upstream = await self._reserve(request)
        for attempt in range(2):
            try:
                response = await self._pool.request("POST", upstream.url, path, headers, body)
                if response.status_code != 503 or attempt == 1 or not self._elsewhere(request, upstream):
                    return response, upstream
                # 503: the upstream took no work (it is draining or not ready): eject it until the health
                # loop sees it ready again, and send the request elsewhere.
                await response.aclose()
                self._release(upstream)
                self._upstreams.eject(upstream, "answered 503")
                log.warning("request %s: %s answered 503; retrying", request.request_id, upstream.url)
                self._metrics.retries.labels(upstream.url).inc()
                upstream = await self._reserve(request, failed=upstream)
            except (UpstreamUnreachable, UpstreamBroken) as exc:
                self._release(upstream)
                if isinstance(exc, UpstreamUnreachable):
                    self._upstreams.eject(upstream, "unreachable")
                log.warning(
                    "request %s: upstream %s failed before answering (%s)",
                    request.request_id,
                    upstream.url,
                    type(exc).__name__,
                )
                if attempt == 1:
                    raise errors.no_healthy_upstream(request.model) from exc
                self._metrics.retries.labels(upstream.url).inc()
                upstream = await self._reserve(request, failed=upstream)
            except BaseException:  # the deadline's cancellation, or anything unexpected: free the slot
                self._release(upstream)
                raise
        raise AssertionError("unreachable")  # the loop returns or raises

    async def forward(
        self,
        request: RouteRequest,
        raw_body: bytes,
        client_headers: Iterable[tuple[str, str]],
        path: str,
        client_wants_usage: bool,
        client_gone: Callable[[], Awaitable[None]] | None = None,
    ) -> Response:
        """Send ``request`` upstream and return the response to give the client.

        ``client_gone()`` returns when the client hangs up; it is watched while a non-streaming answer is
        awaited: then the upstream connection is closed, so the worker stops, and the client is logged
        and counted with status 499.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self._settings.request_timeout
        body, strip_usage = raw_body, False
        if request.stream and not client_wants_usage:
            # Ask for the usage chunk so token metrics work for streams too, and drop it on the way back.
            stream_options = dict(request.body.get("stream_options") or {}, include_usage=True)
            body, strip_usage = orjson.dumps({**request.body, "stream_options": stream_options}), True
        headers = self._upstream_headers(request, client_headers)
        try:
            async with asyncio.timeout_at(deadline):
                # A non-streaming upstream sends its headers only with the finished answer: watch the client
                # from here on.
                response, upstream = await unless_gone(
                    self._send(request, body, headers, path), None if request.stream else client_gone
                )
        except ClientGone:
            log.info("request %s: client disconnected; closing the upstream request", request.request_id)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except TimeoutError:
            raise errors.upstream_timeout(self._settings.request_timeout) from None

        is_stream = response.header("content-type").startswith("text/event-stream")
        if request.stream and response.status_code == 200 and is_stream:
            return self._relay(request, response, upstream, started, deadline, strip_usage)
        try:
            async with asyncio.timeout_at(deadline):
                content = await unless_gone(response.read(), client_gone)
        except ClientGone:
            log.info("request %s: client disconnected; closing the upstream request", request.request_id)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except TimeoutError:
            raise errors.upstream_timeout(self._settings.request_timeout) from None
        except UpstreamBroken as exc:
            raise errors.bad_gateway(f"The upstream broke off its answer ({type(exc).__name__}).") from exc
        finally:
            await response.aclose()
            self._release(upstream)
        return self._answer(request, response, content)

    # -- answering ---------------------------------------------------------------------------------

    def _record_usage(self, request: RouteRequest, usage: object) -> None:
        """Token metrics, and the tokens charged to the client's key when it has a tokens-per-minute limit."""
        self._metrics.record_usage(request.model, usage)
        if request.key_limits is not None:
            request.key_limits.charge(usage)

    def _answer(self, request: RouteRequest, response: UpstreamResponse, content: bytes) -> Response:
        """A complete upstream answer: its original bytes with its status; errors are kept OpenAI-shaped."""
        try:
            payload = orjson.loads(content)
        except orjson.JSONDecodeError:
            payload = None
        if response.status_code == 200 and isinstance(payload, dict):
            self._record_usage(request, payload.get("usage"))
        if response.status_code >= 400 and not (isinstance(payload, dict) and "error" in payload):
            status = response.status_code
            text = content.decode(errors="replace").strip()[:500] or HTTPStatus(status).phrase
            body = error_body(f"Upstream error: {text}", "upstream_error", f"upstream_{status}")
            return Response(orjson.dumps(body), status_code=status, media_type="application/json")
        return Response(
            content,
            status_code=response.status_code,
            headers=dict(strip_hop_by_hop(response.headers, _NOT_RETURNED)),
        )

    def _relay(
        self,
        request: RouteRequest,
        response: UpstreamResponse,
        upstream: Upstream,
        started: float,
        deadline: float,
        strip_usage: bool,
    ) -> RelayResponse:
        closed = False
        # One timer for the whole stream (an asyncio.timeout per chunk cost ~6% of the relay's CPU).
        response.expire_at(deadline)

        async def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                await response.aclose()
                self._release(upstream)

        async def events() -> AsyncIterator[bytes]:
            chunks = aiter(response)
            pending = b""
            seen_content = False
            while True:
                try:
                    raw = await anext(chunks)
                except StopAsyncIteration:
                    break
                except (TimeoutError, UpstreamBroken) as exc:
                    error = (
                        errors.upstream_timeout(self._settings.request_timeout)
                        if isinstance(exc, TimeoutError)
                        else errors.bad_gateway(f"The upstream broke off the stream ({type(exc).__name__}).")
                    )
                    self._metrics.rejections.labels(error.code).inc()
                    log.warning(
                        "request %s: stream from %s ended early: %s",
                        request.request_id,
                        upstream.url,
                        error.code,
                    )
                    yield sse.error_event(error.body())
                    break
                complete, pending = sse.split_events(pending + raw)
                out = []
                for event in complete:
                    # Parsed only while the metrics need it: until the first content, then usage events.
                    chunk = sse.event_json(event) if not seen_content or sse.may_carry_usage(event) else None
                    if chunk is not None:
                        if not seen_content and sse.has_content(chunk):
                            seen_content = True
                            self._metrics.ttft.labels(request.route, request.model).observe(
                                asyncio.get_running_loop().time() - started
                            )
                        if sse.is_usage_only(chunk):
                            self._record_usage(request, chunk["usage"])
                            if strip_usage:
                                continue
                    out.append(event)
                if out:
                    yield b"".join(out)
            if pending:
                yield pending
            await close()

        return RelayResponse(
            events(),
            on_close=close,
            status_code=response.status_code,
            headers=dict(strip_hop_by_hop(response.headers, _NOT_RETURNED)),
        )
