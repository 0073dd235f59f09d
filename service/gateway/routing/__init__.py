"""Routing strategies, built by name: the names are the CLI's ``--routing`` choices."""

from __future__ import annotations

from collections.abc import Callable

from squeezeserve.service.gateway.config import RoutingName
from squeezeserve.service.gateway.routing.base import RouteRequest, RoutingStrategy
from squeezeserve.service.gateway.routing.least_outstanding import LeastOutstanding
from squeezeserve.service.gateway.routing.round_robin import RoundRobin

STRATEGIES: dict[RoutingName, Callable[[], RoutingStrategy]] = {
    "least_outstanding": LeastOutstanding,
    "round_robin": RoundRobin,
}


def build_strategy(name: RoutingName) -> RoutingStrategy:
    try:
        return STRATEGIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing strategy {name!r}; choose one of {sorted(STRATEGIES)}") from None


__all__ = ["RouteRequest", "RoutingStrategy", "build_strategy", "STRATEGIES"]
