"""The upstream registry: which workers are healthy, which models each serves, how busy each is.

A background loop probes every upstream each ``health_interval`` seconds: ``GET /health`` then
``GET /v1/models``. An upstream is ejected after ``unhealthy_threshold`` consecutive failed probes, and at
once when a proxied request cannot connect to it (nothing listens there: waiting for more probes would only
send more requests into the void). One successful probe re-admits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger(__name__)


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
    ) -> None:
        self.upstreams = [Upstream(url) for url in urls]
        self._client = client
        self._interval = health_interval
        self._timeout = health_timeout
        self._threshold = unhealthy_threshold
        self._headers = headers or {}
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

    def mark_unreachable(self, upstream: Upstream) -> None:
        """A request could not connect: eject now; the health loop re-admits it when it answers again."""
        if upstream.healthy:
            log.warning("upstream %s unreachable; ejected", upstream.url)
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
            return
        if not upstream.healthy:
            log.info("upstream %s healthy, serving %s", upstream.url, sorted(models))
        upstream.models = models
        upstream.healthy = True
        upstream.consecutive_failures = 0

    async def check_all(self) -> None:
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
