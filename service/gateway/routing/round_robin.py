"""Round-robin: each candidate in turn."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from squeezeserve.service.gateway.routing.base import RouteRequest
from squeezeserve.service.gateway.upstreams import Upstream


class RoundRobin:
    """Cycles through the candidates. The counter is shared across models, so with a changing candidate
    set the order is fair over time, not per model."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    async def select(self, candidates: Sequence[Upstream], request: RouteRequest) -> Upstream:
        return candidates[next(self._counter) % len(candidates)]
