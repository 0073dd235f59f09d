"""Routing strategies, built by name: the names are the CLI's ``--routing`` choices and the values a
request may name in the ``X-Squeezeserve-Routing`` header."""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence

from squeezeserve.service.gateway.config import GatewaySettings, RoutingName
from squeezeserve.service.gateway.routing.base import RouteRequest, RoutingStrategy
from squeezeserve.service.gateway.routing.least_outstanding import LeastOutstanding
from squeezeserve.service.gateway.routing.prefix_affinity import PrefixAffinity
from squeezeserve.service.gateway.routing.round_robin import RoundRobin
from squeezeserve.service.gateway.upstreams import Upstream

ROUTING_NAMES: tuple[str, ...] = typing.get_args(RoutingName)

STRATEGIES: dict[RoutingName, Callable[[GatewaySettings], RoutingStrategy]] = {
    "least_outstanding": lambda settings: LeastOutstanding(),
    "round_robin": lambda settings: RoundRobin(),
    "prefix_affinity": lambda settings: PrefixAffinity(
        settings.affinity_prefix_chars, settings.affinity_load_factor
    ),
}


class PerRequest:
    """The deployment's strategy, unless a request names another (``RouteRequest.routing``). Every
    strategy is built once, so each keeps its own state (counters, rings) across requests."""

    def __init__(self, default: RoutingName, strategies: dict[str, RoutingStrategy]) -> None:
        self.default = default
        self._strategies = strategies

    async def select(self, candidates: Sequence[Upstream], request: RouteRequest) -> Upstream:
        return await self._strategies[request.routing or self.default].select(candidates, request)


def build_strategy(settings: GatewaySettings) -> RoutingStrategy:
    return PerRequest(settings.routing, {name: make(settings) for name, make in STRATEGIES.items()})


__all__ = ["ROUTING_NAMES", "RouteRequest", "RoutingStrategy", "build_strategy", "STRATEGIES"]
