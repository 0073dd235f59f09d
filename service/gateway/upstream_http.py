"""The proxy's HTTP/1.1 client: keep-alive connections to each upstream, responses parsed by httptools.

httpx cost the gateway most of its CPU (issue #21): its connection pool scans every connection on each
request start and end, so at 64 concurrent requests a third of the gateway's time went to
``_assign_requests_to_connections``; and each body chunk crossed anyio, httpcore and h11 in Python. This
client does only what the proxy needs: one request per connection at a time, idle connections kept per
upstream (last used first), responses parsed by httptools (llhttp, the C parser uvicorn uses), the body
handed over chunk by chunk as it arrives (chunked transfer decoding included).

Failures are told apart the way the proxy acts on them: :class:`UpstreamUnreachable` (nothing accepted the
connection: eject the upstream) and :class:`UpstreamBroken` (the connection broke: retry when it broke
before the answer started). Deadlines are the caller's: cancel the awaiting task, or give a streamed body
one with :meth:`UpstreamResponse.expire_at`; the connection is then closed, never reused.
:meth:`UpstreamPool.abort` breaks every connection to one upstream at once (one that hangs: its requests
then fail over instead of waiting out their deadline).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator, Iterable
from urllib.parse import urlsplit

import httptools

# Past this many unread body bytes the socket stops being read, so a slow client slows the upstream down
# (TCP backpressure) instead of the gateway buffering a whole answer.
_HIGH_WATER = 256 * 1024
_MAX_IDLE_PER_UPSTREAM = 100


class UpstreamUnreachable(Exception):
    """The connection could not be made (refused, unresolvable, or past the connect timeout)."""


class UpstreamBroken(Exception):
    """The connection broke or the upstream sent something that is not HTTP/1.1."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._headers: list[tuple[str, str]] = []
        self._head_received: asyncio.Future[None] | None = None
        self._body: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._body_waiter: asyncio.Future[None] | None = None
        self._paused = False
        self.complete = False
        self._keep_alive = False
        self.broken: Exception | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's: no subclass)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(UpstreamBroken(f"invalid HTTP from upstream: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.complete:
            self.fail(UpstreamBroken("the upstream closed the connection"))

    # -- httptools callbacks ---------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        if self._head_received is not None and not self._head_received.done():
            self._head_received.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and self.transport is not None and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        # Asked now: once the message is complete the parser is reset for the next one.
        self._keep_alive = self._parser.should_keep_alive()
        self._wake()

    # -- used by the pool and the response -------------------------------------------------------------

    def _wake(self) -> None:
        if self._body_waiter is not None and not self._body_waiter.done():
            self._body_waiter.set_result(None)

    def fail(self, exc: Exception) -> None:
        if self.broken is None:
            self.broken = exc
        if self._head_received is not None and not self._head_received.done():
            self._head_received.set_exception(exc)
            self._head_received.exception()  # marked retrieved: the awaiting request may be gone already
        self._wake()

    @property
    def reusable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and self.broken is None

    async def start(self, request: bytes) -> tuple[int, list[tuple[str, str]]]:
        """Send one request; return status and headers once they have arrived."""
        assert self.transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self._headers = []
        self.complete = self._keep_alive = False
        self._head_received = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        await self._head_received
        return self._parser.get_status_code(), self._headers

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body as it arrived, or None at its end."""
        while not self._body:
            if self.complete:
                return None
            if self.broken is not None:
                raise self.broken
            self._body_waiter = asyncio.get_running_loop().create_future()
            await self._body_waiter
        chunk = self._body.popleft()
        self._buffered -= len(chunk)
        if self._paused and self._buffered <= _HIGH_WATER // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return chunk

    def keeps_alive(self) -> bool:
        return self.complete and self._keep_alive and self.reusable

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """Status and headers of an answer whose body is read with :meth:`read` or iterated as it arrives.
    :meth:`aclose` must be called: it gives the connection back when the body was read to its end,
    else closes it (which is how the upstream learns the client has gone)."""

    def __init__(
        self,
        pool: UpstreamPool,
        key: str,
        connection: _Connection,
        status: int,
        headers: list[tuple[str, str]],
    ) -> None:
        self._pool = pool
        self._key = key
        self._connection: _Connection | None = connection
        self._timer: asyncio.TimerHandle | None = None
        self.status_code = status
        self.headers = headers

    def expire_at(self, when: float) -> None:
        """At loop time ``when``, end the body: reading it raises ``TimeoutError``, the connection closes."""
        self._timer = asyncio.get_running_loop().call_at(when, self._expire)

    def _expire(self) -> None:
        if self._connection is not None:
            self._connection.fail(TimeoutError())
            self._connection.close()

    def header(self, name: str, default: str = "") -> str:
        """The first value of header ``name`` (lower case)."""
        return next((value for key, value in self.headers if key == name), default)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        assert self._connection is not None
        while (chunk := await self._connection.next_chunk()) is not None:
            yield chunk

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    async def aclose(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        connection, self._connection = self._connection, None
        if connection is not None:
            self._pool.release(self._key, connection)


class UpstreamPool:
    """Keep-alive connections per upstream base URL, and requests over them."""

    def __init__(self, connect_timeout: float) -> None:
        self._connect_timeout = connect_timeout
        self._idle: dict[str, list[_Connection]] = collections.defaultdict(list)
        # Connections carrying a request now, so that abort() can reach them.
        self._busy: dict[str, set[_Connection]] = collections.defaultdict(set)
        self._targets: dict[str, tuple[str, int, ssl.SSLContext | None, bytes]] = {}
        self._closed = False

    def _target(self, base_url: str) -> tuple[str, int, ssl.SSLContext | None, bytes]:
        if (target := self._targets.get(base_url)) is None:
            parts = urlsplit(base_url)
            secure = parts.scheme == "https"
            port = parts.port or (443 if secure else 80)
            host = parts.hostname or ""
            context = ssl.create_default_context() if secure else None
            target = self._targets[base_url] = (host, port, context, parts.netloc.encode("idna"))
        return target

    async def _connect(self, base_url: str) -> _Connection:
        host, port, context, _ = self._target(base_url)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, connection = await loop.create_connection(_Connection, host, port, ssl=context)
        except (OSError, TimeoutError) as exc:
            raise UpstreamUnreachable(f"{type(exc).__name__}: {exc}") from exc
        return connection

    async def request(
        self, method: str, base_url: str, path: str, headers: Iterable[tuple[str, str]], body: bytes = b""
    ) -> UpstreamResponse:
        """Send a request to ``base_url`` + ``path``; return once the response's headers have arrived.

        Raises :class:`UpstreamUnreachable` or, when the connection broke before the answer started,
        :class:`UpstreamBroken`. ``Host`` and ``Content-Length`` are set here; ``headers`` must hold
        neither (nor hop-by-hop ones)."""
        idle = self._idle[base_url]
        connection = None
        while idle:
            candidate = idle.pop()
            if candidate.reusable:
                connection = candidate
                break
        if connection is None:
            connection = await self._connect(base_url)
        busy = self._busy[base_url]
        busy.add(connection)
        lines = [f"{method} {path} HTTP/1.1\r\n".encode(), b"host: %s\r\n" % self._target(base_url)[3]]
        lines += [f"{name}: {value}\r\n".encode("latin-1") for name, value in headers]
        lines.append(b"content-length: %d\r\n\r\n" % len(body))
        lines.append(body)
        try:
            status, response_headers = await connection.start(b"".join(lines))
        except BaseException:
            busy.discard(connection)
            connection.close()
            raise
        return UpstreamResponse(self, base_url, connection, status, response_headers)

    def release(self, base_url: str, connection: _Connection) -> None:
        self._busy[base_url].discard(connection)
        idle = self._idle[base_url]
        if not self._closed and connection.keeps_alive() and len(idle) < _MAX_IDLE_PER_UPSTREAM:
            idle.append(connection)
        else:
            connection.close()

    def abort(self, base_url: str, reason: str = "the gateway cut the connection: the upstream hangs") -> int:
        """Break every connection to ``base_url``, busy or idle: a request waiting for its answer fails with
        :class:`UpstreamBroken` (``reason``) at once. Returns how many requests were cut."""
        busy = self._busy.pop(base_url, set())
        for connection in [*busy, *self._idle.pop(base_url, [])]:
            connection.fail(UpstreamBroken(reason))
            connection.close()
        return len(busy)

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
            idle.clear()
