"""Prefix affinity: a shared prompt prefix or session sticks to one upstream, with load bounded."""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import httpx
import pytest

from squeezeserve.service.gateway.routing import RouteRequest
from squeezeserve.service.gateway.routing.prefix_affinity import PrefixAffinity, prompt_prefix
from squeezeserve.service.gateway.upstreams import Upstream

SYSTEM_PROMPTS = [
    f"You are assistant number {i}. " + "Follow the house style guide carefully. " * 20 for i in range(16)
]


def chat(system: str, user: str, session: str | None = None) -> RouteRequest:
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }
    return RouteRequest("/v1/chat/completions", "m", "r", False, body, session_id=session)


def select(strategy: PrefixAffinity, upstreams: list[Upstream], request: RouteRequest) -> Upstream:
    return asyncio.run(strategy.select(upstreams, request))


def test_requests_sharing_a_system_prompt_go_to_one_upstream() -> None:
    upstreams = [Upstream(f"http://w{i}:8000") for i in range(3)]
    strategy = PrefixAffinity()
    for system in SYSTEM_PROMPTS:
        chosen = {select(strategy, upstreams, chat(system, f"question {u}")).url for u in range(10)}
        assert len(chosen) == 1, system[:30]


def test_distinct_prefixes_spread_over_the_upstreams() -> None:
    upstreams = [Upstream(f"http://w{i}:8000") for i in range(3)]
    strategy = PrefixAffinity()
    counts = Counter(select(strategy, upstreams, chat(f"system {k}", "hi")).url for k in range(600))
    assert set(counts) == {u.url for u in upstreams}
    assert max(counts.values()) / min(counts.values()) < 1.6  # 64 points each: shares near 1/3


def test_a_hot_prefix_spills_over_at_the_load_cap() -> None:
    upstreams = [Upstream(f"http://w{i}:8000") for i in range(2)]
    strategy = PrefixAffinity(load_factor=0.25)
    hot = chat(SYSTEM_PROMPTS[0], "same again")
    for _ in range(40):  # 40 requests in flight at once, all with one prefix
        select(strategy, upstreams, hot).in_flight += 1
    loads = sorted(u.in_flight for u in upstreams)
    assert loads[1] <= math.ceil(1.25 * 40 / 2)  # bounded: never more than (1 + 0.25) x the mean
    assert loads[0] > 0


def test_a_session_header_wins_over_the_prompt() -> None:
    upstreams = [Upstream(f"http://w{i}:8000") for i in range(4)]
    strategy = PrefixAffinity()
    chosen = {select(strategy, upstreams, chat(f"system {k}", "hi", session="user-7")).url for k in range(50)}
    assert len(chosen) == 1


def test_removing_an_upstream_moves_only_its_own_keys() -> None:
    upstreams = [Upstream(f"http://w{i}:8000") for i in range(4)]
    strategy = PrefixAffinity()
    keys = [chat(f"system {k}", "hi") for k in range(400)]
    before = [select(strategy, upstreams, r).url for r in keys]
    gone = upstreams[1].url
    after = [select(strategy, [u for u in upstreams if u.url != gone], r).url for r in keys]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert moved and all(b == gone for b, _ in moved)


def test_prompt_prefix_reads_completions_and_chat_content_parts() -> None:
    assert prompt_prefix({"prompt": "abcdef"}, 3) == "abc"
    assert prompt_prefix({"prompt": ["first", "second"]}, 10) == "first"
    assert prompt_prefix({"prompt": [1, 2, 3]}, 10) == ""  # token ids: no text, least-loaded fallback
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    assert prompt_prefix(parts, 100) == "user: hello\n"


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="prefix_chars"):
        PrefixAffinity(prefix_chars=0)
    with pytest.raises(ValueError, match="load_factor"):
        PrefixAffinity(load_factor=0)


@pytest.mark.slow
def test_through_the_gateway_with_per_request_override(fake_upstream, start_gateway) -> None:
    upstreams = [fake_upstream(name) for name in ("a", "b", "c")]
    base = start_gateway([u.url for u in upstreams], routing="prefix_affinity")

    def served(system: str, user: str, **headers: str) -> str:
        body = {"model": "fake-model", "messages": [{"role": "system", "content": system},
                                                    {"role": "user", "content": user}]}  # fmt: skip
        response = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=10)
        assert response.status_code == 200, response.text
        return response.json()["system_fingerprint"]

    for system in SYSTEM_PROMPTS[:4]:
        assert len({served(system, f"user {u}") for u in range(5)}) == 1
    spread = {served(SYSTEM_PROMPTS[0], "x", **{"X-Squeezeserve-Routing": "round_robin"}) for _ in range(6)}
    assert spread == {"a", "b", "c"}
    bad = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "fake-model", "messages": [{"role": "user", "content": "x"}]},
        headers={"X-Squeezeserve-Routing": "random"},
        timeout=10,
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "x-squeezeserve-routing"
