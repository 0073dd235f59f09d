"""The upstream registry: which workers are healthy, which models each serves, how busy each is.

A background loop probes every upstream each ``health_interval`` seconds: ``GET /health`` then
``GET /v1/models``. An upstream is ejected after ``unhealthy_threshold`` consecutive failed probes, and at
once when a proxied request cannot connect to it (nothing listens there: waiting for more probes would only
send more requests into the void). One successful probe re-admits it.

An ejected upstream that does not even answer its probe in time (``health_timeout``) is hung (SIGSTOP, a
wedged event loop, a network partition): ``on_unresponsive(url)`` (the proxy's pool) breaks the requests
still waiting on it, so they fail over (or end with an error event) now instead of at their deadline. A
refused probe does not count as hung: a draining worker stops listening while it finishes its requests, and
a dead one has broken its connections itself.

Discovery: an upstream written ``dns+http://NAME:PORT`` stands for every address NAME resolves to, each an
upstream of its own (``http://ADDRESS:PORT``), resolved again before every round of probes. With a
Kubernetes headless Service as NAME, every worker Pod is routed to on its own (least outstanding, prefix
affinity), where a plain Service's virtual IP would hide them behind one address. Addresses that disappear
are dropped once no request is in flight on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

log = logging.getLogger(__name__)

DISCOVERY_SCHEME = "dns+"
# (host, port) -> the host's addresses; the event loop's getaddrinfo by default, replaceable in tests.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_addresses(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def _address_url(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"{scheme}://{host}:{port}"


@dataclass(eq=False)
class Upstream:
    """One OpenAI-compatible worker. ``models`` maps model id -> its card from ``/v1/models``."""

    url: str
    healthy: bool = False
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    in_flight: int = 0
    consecutive_failures: int = 0

    def serves(self, model: str) -> bool:
        return model in self.models


class UpstreamRegistry:
    """Holds the upstreams and keeps their health and model lists current."""

    def __init__(
        self,
        urls: Sequence[str],
        client: httpx.AsyncClient,
        *,
        health_interval: float,
        health_timeout: float,
        unhealthy_threshold: int,
        headers: dict[str, str] | None = None,
        resolver: Resolver = resolve_addresses,
        on_unresponsive: Callable[[str], int] | None = None,
    ) -> None:
        self._discovered = [url for url in urls if url.startswith(DISCOVERY_SCHEME)]
        self.upstreams = [Upstream(url) for url in urls if not url.startswith(DISCOVERY_SCHEME)]
        self._resolver = resolver
        self._tracked: dict[str, set[str]] = {spec: set() for spec in self._discovered}
        self._client = client
        self._interval = health_interval
        self._timeout = health_timeout
        self._threshold = unhealthy_threshold
        self._headers = headers or {}
        self._on_unresponsive = on_unresponsive
        self._task: asyncio.Task[None] | None = None

    # -- queries -------------------------------------------------------------------------------------

    def healthy(self) -> list[Upstream]:
        return [u for u in self.upstreams if u.healthy]

    def candidates(self, model: str) -> list[Upstream]:
        """Healthy upstreams serving ``model``."""
        return [u for u in self.upstreams if u.healthy and u.serves(model)]

    def is_known(self, model: str) -> bool:
        """Whether any upstream, healthy or not, has ever listed ``model``."""
        return any(u.serves(model) for u in self.upstreams)

    def models(self) -> list[dict[str, Any]]:
        """The union of the healthy upstreams' model cards, first upstream's card winning per id."""
        union: dict[str, dict[str, Any]] = {}
        for upstream in self.healthy():
            for model_id, card in upstream.models.items():
                union.setdefault(model_id, card)
        return list(union.values())

    # -- state changes ---------------------------------------------------------------------------------

    def eject(self, upstream: Upstream, why: str) -> None:
        """A request found ``upstream`` unusable (unreachable, or answering 503): eject it now; the health
        loop re-admits it when it answers its probes again."""
        if upstream.healthy:
            log.warning("upstream %s %s; ejected", upstream.url, why)
        upstream.healthy = False
        upstream.consecutive_failures = max(upstream.consecutive_failures, self._threshold)

    async def check(self, upstream: Upstream) -> None:
        """Probe one upstream and update its health and model list."""
        try:
            health = await self._client.get(
                f"{upstream.url}/health", timeout=self._timeout, headers=self._headers
            )
            health.raise_for_status()
            listing = await self._client.get(
                f"{upstream.url}/v1/models", timeout=self._timeout, headers=self._headers
            )
            listing.raise_for_status()
            cards = listing.json()["data"]
            models = {str(card["id"]): card for card in cards}
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            upstream.consecutive_failures += 1
            if upstream.healthy and upstream.consecutive_failures >= self._threshold:
                upstream.healthy = False
                log.warning(
                    "upstream %s ejected after %d failed checks (%s)", upstream.url, self._threshold, exc
                )
            if not upstream.healthy and isinstance(exc, httpx.TimeoutException) and self._on_unresponsive:
                cut = self._on_unresponsive(upstream.url)
                if cut:
                    log.warning(
                        "upstream %s does not answer: cut the %d requests waiting on it", upstream.url, cut
                    )
            return
        if not upstream.healthy:
            log.info("upstream %s healthy, serving %s", upstream.url, sorted(models))
        upstream.models = models
        upstream.healthy = True
        upstream.consecutive_failures = 0

    async def discover(self) -> None:
        """Resolve every ``dns+`` upstream again: add new addresses, drop vanished idle ones."""
        for spec in self._discovered:
            parts = urlsplit(spec[len(DISCOVERY_SCHEME) :])
            port = parts.port or (443 if parts.scheme == "https" else 80)
            try:
                addresses = await self._resolver(parts.hostname or "", port)
            except OSError as exc:  # a failed lookup keeps what was found before
                log.warning(
                    "cannot resolve %s (%s); keeping %d known upstreams", spec, exc, len(self.upstreams)
                )
                continue
            found = {_address_url(parts.scheme, address, port) for address in addresses}
            known = {u.url for u in self.upstreams}
            for url in sorted(found - known):
                log.info("discovered upstream %s (%s)", url, spec)
                self.upstreams.append(Upstream(url))
            gone = self._tracked[spec] - found
            for upstream in [u for u in self.upstreams if u.url in gone and u.in_flight == 0]:
                log.info("upstream %s no longer resolves from %s; dropped", upstream.url, spec)
                self.upstreams.remove(upstream)
            self._tracked[spec] = found | {u.url for u in self.upstreams if u.url in gone}

    async def check_all(self) -> None:
        if self._discovered:
            await self.discover()
        await asyncio.gather(*(self.check(u) for u in self.upstreams))

    # -- background loop -------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.check_all()

    async def start(self) -> None:
        """Probe every upstream once (so the gateway is ready as soon as it listens), then keep probing."""
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="upstream-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
