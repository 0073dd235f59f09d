"""Routing strategies: each one's choice on its own, and the distribution through a running gateway."""

from __future__ import annotations

import asyncio
import threading
import typing
from collections import Counter

import pytest

from squeezeserve.service.gateway.config import GatewaySettings, RoutingName
from squeezeserve.service.gateway.routing import STRATEGIES, RouteRequest, build_strategy
from squeezeserve.service.gateway.upstreams import Upstream

REQUEST = RouteRequest(route="/v1/completions", model="m", request_id="r", stream=False, body={})


def choose(strategy_name: RoutingName, upstreams: list[Upstream], times: int) -> Counter[str]:
    strategy = build_strategy(GatewaySettings(upstreams=["http://u:1"], routing=strategy_name))

    async def run() -> Counter[str]:
        return Counter([(await strategy.select(upstreams, REQUEST)).url for _ in range(times)])

    return asyncio.run(run())


def test_every_cli_choice_has_a_strategy():
    assert set(STRATEGIES) == set(typing.get_args(RoutingName))


def test_unknown_strategy_name_is_a_clear_error():
    with pytest.raises(ValueError, match="routing"):
        GatewaySettings(upstreams=["http://u:1"], routing="random")  # type: ignore[arg-type]


def test_round_robin_takes_turns_regardless_of_load():
    upstreams = [Upstream("a", in_flight=5), Upstream("b"), Upstream("c")]

    assert choose("round_robin", upstreams, 9) == {"a": 3, "b": 3, "c": 3}


def test_least_outstanding_picks_the_least_busy():
    upstreams = [Upstream("a", in_flight=3), Upstream("b", in_flight=1), Upstream("c", in_flight=2)]

    assert choose("least_outstanding", upstreams, 5) == {"b": 5}


def test_least_outstanding_shares_ties_evenly():
    upstreams = [Upstream("a", in_flight=1), Upstream("b"), Upstream("c")]

    assert choose("least_outstanding", upstreams, 10) == {"b": 5, "c": 5}


@pytest.mark.slow
def test_round_robin_distribution_through_the_gateway(fake_upstream, start_gateway, openai_client):
    upstreams = [fake_upstream("a"), fake_upstream("b"), fake_upstream("c")]
    client = openai_client(start_gateway([u.url for u in upstreams], routing="round_robin"))

    served = Counter(
        client.completions.create(model="fake-model", prompt="x").system_fingerprint for _ in range(9)
    )

    assert served == {"a": 3, "b": 3, "c": 3}


@pytest.mark.slow
def test_least_outstanding_sends_everything_past_a_busy_upstream(
    fake_upstream, start_gateway, openai_client, eventually
):
    upstreams = {"a": fake_upstream("a"), "b": fake_upstream("b")}
    client = openai_client(start_gateway([u.url for u in upstreams.values()]))
    slow = threading.Thread(
        target=client.completions.create,
        kwargs={"model": "fake-model", "prompt": "x", "extra_body": {"fake": {"delay": 1.0}}},
    )
    slow.start()
    eventually(lambda: any(u.app.state.received for u in upstreams.values()))
    busy = next(name for name, u in upstreams.items() if u.app.state.received)

    served = Counter(
        client.completions.create(model="fake-model", prompt="x").system_fingerprint for _ in range(6)
    )
    slow.join()

    assert served == {({"a", "b"} - {busy}).pop(): 6}
