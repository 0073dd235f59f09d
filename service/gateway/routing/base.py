"""The interface every routing strategy implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from squeezeserve.service.gateway.upstreams import Upstream

if TYPE_CHECKING:
    from squeezeserve.service.gateway.ratelimit import KeyLimits


@dataclass(frozen=True)
class RouteRequest:
    """What a strategy may look at to choose: the validated request, not the raw HTTP one."""

    route: str
    model: str
    request_id: str
    stream: bool
    body: dict[str, Any]
    session_id: str | None = None  # the X-Session-Id header: keeps a conversation on one upstream
    routing: str | None = (
        None  # the X-Squeezeserve-Routing header: this request's strategy, if not the default
    )
    key_limits: KeyLimits | None = None  # the client key's limits, charged with the answer's usage


class RoutingStrategy(Protocol):
    async def select(self, candidates: Sequence[Upstream], request: RouteRequest) -> Upstream:
        """Pick one of ``candidates`` (never empty: healthy, serving the model, below their in-flight
        limit) for ``request``."""
        ...
