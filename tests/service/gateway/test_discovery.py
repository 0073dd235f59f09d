"""Upstream discovery: ``dns+http://NAME:PORT`` is every address NAME resolves to, kept current."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from squeezeserve.service.gateway.upstreams import UpstreamRegistry


class Answers:
    """A resolver whose answer the test changes between rounds."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if not self.addresses:
            raise OSError("Name or service not known")
        return self.addresses


def registry(answers: Answers, *urls: str) -> UpstreamRegistry:
    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(503)))
    return UpstreamRegistry(
        list(urls), client, health_interval=1, health_timeout=1, unhealthy_threshold=1, resolver=answers
    )


def test_each_address_becomes_an_upstream_and_vanished_idle_ones_go() -> None:
    answers = Answers("10.0.0.1", "10.0.0.2")
    upstreams = registry(answers, "dns+http://workers.llm.svc:8001", "http://static:8001")
    asyncio.run(upstreams.discover())
    assert answers.asked == [("workers.llm.svc", 8001)]
    assert [u.url for u in upstreams.upstreams] == [
        "http://static:8001",
        "http://10.0.0.1:8001",
        "http://10.0.0.2:8001",
    ]

    busy = upstreams.upstreams[2]
    busy.in_flight = 1
    answers.addresses = ["10.0.0.3"]  # a rollout: .1 and .2 gone, .3 new
    asyncio.run(upstreams.discover())
    assert [u.url for u in upstreams.upstreams] == [
        "http://static:8001",
        "http://10.0.0.2:8001",
        "http://10.0.0.3:8001",
    ]

    busy.in_flight = 0  # its last request finished: dropped at the next round
    asyncio.run(upstreams.discover())
    assert [u.url for u in upstreams.upstreams] == ["http://static:8001", "http://10.0.0.3:8001"]


def test_a_failed_lookup_keeps_the_known_upstreams_and_ipv6_is_bracketed() -> None:
    answers = Answers("fd00::7")
    upstreams = registry(answers, "dns+http://workers:8001")
    asyncio.run(upstreams.discover())
    assert [u.url for u in upstreams.upstreams] == ["http://[fd00::7]:8001"]
    answers.addresses = []
    asyncio.run(upstreams.discover())
    assert [u.url for u in upstreams.upstreams] == ["http://[fd00::7]:8001"]


@pytest.mark.slow
def test_the_gateway_serves_through_a_discovered_upstream(
    fake_upstream, start_gateway, openai_client
) -> None:
    upstream = fake_upstream("a")
    port = upstream.url.rsplit(":", 1)[1]
    client = openai_client(start_gateway([f"dns+http://localhost:{port}"]))
    answer = client.completions.create(model="fake-model", prompt="x")
    assert answer.system_fingerprint == "a"
