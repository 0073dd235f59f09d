"""Per-key limits: requests and tokens per minute, 429 with Retry-After, OpenAI's x-ratelimit-* headers."""

from __future__ import annotations

import httpx
import openai
import pytest

from squeezeserve.service.errors import APIError
from squeezeserve.service.gateway.config import ApiKey, GatewaySettings
from squeezeserve.service.gateway.ratelimit import KeyLimits, build_key_limits, format_duration

HEADERS = ("limit", "remaining", "reset")


class Clock:
    """A clock the test moves by hand: bucket arithmetic without waiting a minute."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0ms"), (0.1201, "121ms"), (1.0, "1s"), (8.64, "8.64s"), (360.0, "6m0s"), (179.56, "2m59.56s")],
)
def test_reset_durations_are_written_like_openai(seconds, text):
    assert format_duration(seconds) == text


def test_requests_per_minute_admits_a_burst_then_one_per_interval():
    clock = Clock()
    limits = KeyLimits(requests_per_minute=2, tokens_per_minute=None, clock=clock)
    limits.admit()
    limits.admit()

    with pytest.raises(APIError) as caught:
        limits.admit()

    error = caught.value
    assert (error.status, error.type, error.code) == (429, "requests", "rate_limit_exceeded")
    assert error.headers["Retry-After"] == "30"  # one request back every 60 / 2 s
    clock.now += 29.9
    with pytest.raises(APIError):
        limits.admit()
    clock.now += 0.1
    limits.admit()


def test_tokens_are_charged_from_usage_and_a_debt_is_paid_back_in_time():
    clock = Clock()
    limits = KeyLimits(requests_per_minute=None, tokens_per_minute=120, clock=clock)
    limits.admit()
    limits.charge({"prompt_tokens": 100, "completion_tokens": 80, "total_tokens": 180})  # 60 in debt

    with pytest.raises(APIError) as caught:
        limits.admit()

    assert caught.value.type == "tokens"
    assert caught.value.headers["Retry-After"] == "31"  # back above zero (61 tokens at 2/s) after 30.5 s
    clock.now += 30.5
    limits.admit()
    assert dict(limits.headers()) == {
        "x-ratelimit-limit-tokens": "120",
        "x-ratelimit-remaining-tokens": "1",
        "x-ratelimit-reset-tokens": "59.5s",
    }


def test_usage_without_total_counts_prompt_plus_completion():
    limits = KeyLimits(requests_per_minute=None, tokens_per_minute=100, clock=Clock())
    limits.charge({"prompt_tokens": 7, "completion_tokens": 5})
    limits.charge("not usage")

    assert dict(limits.headers())["x-ratelimit-remaining-tokens"] == "88"


def test_only_keys_with_limits_get_buckets():
    settings = GatewaySettings(
        upstreams=["http://a:1"],
        api_keys=["free", ApiKey(key="own", requests_per_minute=5), "other"],
        tokens_per_minute=1000,
    )
    unlimited = GatewaySettings(upstreams=["http://a:1"], api_keys=["free"])

    table = build_key_limits(settings)

    assert set(table) == {"free", "own", "other"}  # the default applies to every key without its own
    assert table["own"].requests is not None and table["own"].tokens is not None
    assert table["free"].requests is None
    assert build_key_limits(unlimited) == {}


# -- through the gateway ------------------------------------------------------------------------------


def _post(gateway: str, key: str, **body) -> httpx.Response:
    body = {"model": "fake-model", "prompt": "x", **body}
    return httpx.post(f"{gateway}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})


@pytest.mark.slow
def test_limited_key_gets_429_with_retry_after_and_headers_others_do_not(fake_upstream, start_gateway):
    gateway = start_gateway(
        [fake_upstream().url],
        api_keys=[ApiKey(key="limited", requests_per_minute=2), "free"],
    )

    first, second, third = (_post(gateway, "limited") for _ in range(3))
    free = [_post(gateway, "free") for _ in range(3)]

    assert (first.status_code, second.status_code, third.status_code) == (200, 200, 429)
    assert [
        first.headers["x-ratelimit-remaining-requests"],
        second.headers["x-ratelimit-remaining-requests"],
    ] == [
        "1",
        "0",
    ]
    assert third.headers["retry-after"] in ("29", "30")  # one request back every 60 / 2 s
    assert third.headers["x-ratelimit-limit-requests"] == "2"
    assert third.json()["error"]["code"] == "rate_limit_exceeded"
    assert third.json()["error"]["type"] == "requests"
    assert all(r.status_code == 200 for r in free)
    assert not any(name.startswith("x-ratelimit") for r in free for name in r.headers)


@pytest.mark.slow
def test_limited_key_gets_the_headers_on_every_response(fake_upstream, start_gateway):
    gateway = start_gateway([fake_upstream().url], api_keys=[ApiKey(key="k", requests_per_minute=6)])
    headers = {"authorization": "Bearer k"}

    answers = {
        "ok": _post(gateway, "k"),
        "stream": _post(gateway, "k", stream=True),
        "bad request": _post(gateway, "k", temperature=-1),
        "upstream error": _post(gateway, "k", fake={"status": 500}),
        "models": httpx.get(f"{gateway}/v1/models", headers=headers),
    }

    assert [r.status_code for r in answers.values()] == [200, 200, 400, 500, 200]
    for name, response in answers.items():
        for kind in HEADERS:
            assert f"x-ratelimit-{kind}-requests" in response.headers, name
    # Every completion request counted (the bad one too: it was made); listing models is not.
    assert answers["models"].headers["x-ratelimit-remaining-requests"] == "2"


@pytest.mark.slow
def test_tokens_per_minute_counts_the_usage_of_answers_and_streams(
    fake_upstream, start_gateway, openai_client
):
    # The fake's usage: 1 prompt token ("x") + 3 completion tokens per request.
    gateway = start_gateway([fake_upstream().url], api_keys=[ApiKey(key="k", tokens_per_minute=10)])
    client = openai_client(gateway, api_key="k")

    first = client.completions.with_raw_response.create(model="fake-model", prompt="x")  # 4 tokens: 6 left
    list(client.completions.create(model="fake-model", prompt="x", stream=True))  # 4 more: 2 left
    client.completions.create(model="fake-model", prompt="x")  # admitted with 2 left, then 2 in debt
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model="fake-model", prompt="x")

    assert first.headers["x-ratelimit-remaining-tokens"] == "6"  # its own usage was charged before
    assert caught.value.response.headers["x-ratelimit-remaining-tokens"] == "0"
    assert caught.value.body["type"] == "tokens"
    # 2 tokens in debt at 10/60 per second: above zero after ~18 s.
    assert 12 <= int(caught.value.response.headers["retry-after"]) <= 19
