"""Least outstanding requests: the candidate with the fewest requests in flight."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from squeezeserve.service.gateway.routing.base import RouteRequest
from squeezeserve.service.gateway.upstreams import Upstream


class LeastOutstanding:
    """Picks the minimum of ``in_flight``. Ties rotate, so idle upstreams share sequential traffic evenly
    instead of the first one in the list taking it all (which would leave the others' caches cold)."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    async def select(self, candidates: Sequence[Upstream], request: RouteRequest) -> Upstream:
        fewest = min(u.in_flight for u in candidates)
        tied = [u for u in candidates if u.in_flight == fewest]
        return tied[next(self._counter) % len(tied)]
