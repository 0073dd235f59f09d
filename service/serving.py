"""Run an ASGI app in the foreground the way an operator expects from Ctrl-C and SIGTERM.

The first signal drains. At once the server stops taking work: the readiness probes (and every route but
``/livez`` and ``/metrics``) answer 503 with ``Retry-After`` in OpenAI's error shape, so a load balancer
or our gateway sends new requests elsewhere, while the requests already running (streams included) go on.
When the last one has finished, or ``grace_seconds`` have passed, the server closes its sockets and
exits. A second signal exits at once, with one line and no tracebacks: the process ends right there
(``os._exit``), after ``on_force_exit`` (e.g. stopping a child worker) has run, so nothing is left half
torn down and printing cancelled tasks. No torch here.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from squeezeserve.service.errors import APIError

FORCED_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for an interrupted program
DEFAULT_GRACE_SECONDS = 30.0
DRAIN_RETRY_AFTER_SECONDS = 1
# Still answered while draining: liveness (the process is fine, do not restart it) and metrics.
OPEN_WHILE_DRAINING = frozenset({"/livez", "/metrics"})
_POLL_S = 0.05


def draining_error() -> APIError:
    return APIError(
        503,
        "The server is shutting down and takes no new requests; retry on another instance.",
        "server_error",
        "draining",
        headers={"Retry-After": str(DRAIN_RETRY_AFTER_SECONDS)},
    )


async def until_disconnected(receive: Receive) -> None:
    """Return as soon as the client of a request whose body has been read hangs up. The server wakes this
    on the disconnect itself, unlike Starlette's ``Request.is_disconnected``, which has to be polled."""
    while (await receive())["type"] != "http.disconnect":
        pass  # body the caller did not read; not expected once it has been


# The status a request gets when its client left before the answer (nginx's "client closed request"); nobody
# receives it, but logs and metrics count it.
CLIENT_CLOSED_REQUEST = 499


class ClientGone(Exception):
    """The client disconnected while we waited for the answer."""


async def unless_gone(work: Awaitable[Any], client_gone: Callable[[], Awaitable[None]] | None) -> Any:
    """Await ``work``, or raise ``ClientGone`` (cancelling it) as soon as ``client_gone()`` returns."""
    task = asyncio.ensure_future(work)
    if client_gone is None:
        return await task
    gone = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():  # also when both are: use the result
            return task.result()
        raise ClientGone
    finally:
        gone.cancel()
        task.cancel()  # no-op once done; otherwise the work's own cleanup runs (e.g. releasing its slot)


class DrainGate:
    """ASGI wrapper that counts the HTTP requests in flight and, once ``draining``, turns new ones away."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.in_flight = 0
        self.draining = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining and scope["path"] not in OPEN_WHILE_DRAINING:
            await draining_error().response()(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server that drains on the first signal (see the module) and exits on the second."""

    def __init__(
        self,
        config: uvicorn.Config,
        name: str,
        gate: DrainGate,
        grace_seconds: float = DEFAULT_GRACE_SECONDS,
        on_force_exit: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self._name = name
        self._gate = gate
        self._grace_seconds = grace_seconds
        self._on_force_exit = on_force_exit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._gate.draining or self.should_exit:
            self._say("second interrupt, exiting now")
            if self._on_force_exit is not None:
                self._on_force_exit()
            os._exit(FORCED_EXIT_CODE)
        self._gate.draining = True
        self._say(
            f"draining: {self._gate.in_flight} request(s) in flight finish first (at most "
            f"{self._grace_seconds:g} s), new ones get 503 (signal again to exit now)"
        )
        if self._loop is None or self._loop.is_closed():  # not serving yet: nothing to wait for
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self._start_drain, sig, frame)

    def _start_drain(self, sig: int, frame: Any) -> None:
        self._drain_task = asyncio.ensure_future(self._drain(sig, frame))

    async def _drain(self, sig: int, frame: Any) -> None:
        deadline = time.monotonic() + self._grace_seconds
        while self._gate.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        if self._gate.in_flight:
            self._say(f"grace period over: closing {self._gate.in_flight} unfinished request(s)")
        super().handle_exit(sig, frame)

    def _say(self, message: str) -> None:
        sys.stderr.write(f"{self._name} {message}\n")
        sys.stderr.flush()


def serve(
    app: Any,
    name: str,
    host: str,
    port: int,
    on_force_exit: Callable[[], None] | None = None,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    **config: Any,
) -> None:
    """Serve ``app`` (called ``name`` in messages) until a signal; ``config`` goes to ``uvicorn.Config``.
    Requests still running ``grace_seconds`` after the first signal are cut off."""
    gate = DrainGate(app)
    # The drain already waited for the requests: uvicorn's own wait only closes idle connections.
    config.setdefault("timeout_graceful_shutdown", 2)
    server_config = uvicorn.Config(gate, host=host, port=port, **config)
    DrainingServer(server_config, name, gate, grace_seconds, on_force_exit).run()
