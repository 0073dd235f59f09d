"""/metrics shows the traffic: requests by route/model/status, latency, TTFT, tokens, upstream gauges."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow  # starts servers

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def test_metrics_show_the_traffic(fake_upstream, start_gateway, openai_client, metric):
    upstream = fake_upstream()
    gateway = start_gateway([upstream.url])
    client = openai_client(gateway)

    client.completions.create(model="fake-model", prompt="one two")  # usage: 2 prompt, 3 completion tokens
    for _ in client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "x"}], stream=True
    ):
        pass
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")

    def requests(route: str, model: str, status: str) -> float:
        return metric(gateway, "squeezeserve_gateway_requests_total", route=route, model=model, status=status)

    assert requests(COMPLETIONS, "fake-model", "200") == 1
    assert requests(CHAT, "fake-model", "200") == 1
    assert requests(COMPLETIONS, "unknown", "404") == 1  # unknown names never become label values
    assert (
        metric(gateway, "squeezeserve_gateway_request_duration_seconds_count", route=CHAT, model="fake-model")
        == 1
    )
    assert (
        metric(
            gateway, "squeezeserve_gateway_time_to_first_token_seconds_count", route=CHAT, model="fake-model"
        )
        == 1
    )
    # TTFT only for streams.
    assert metric(gateway, "squeezeserve_gateway_time_to_first_token_seconds_count", route=COMPLETIONS) == 0
    # Tokens: the fake reports completion_tokens = 3 per request; prompt_tokens = words of the prompt
    # (2 for the completion; the chat stream counts its json-dumped messages; the gateway asked for it).
    assert (
        metric(gateway, "squeezeserve_gateway_tokens_total", model="fake-model", direction="completion") == 6
    )
    assert metric(gateway, "squeezeserve_gateway_tokens_total", model="fake-model", direction="prompt") > 2
    assert metric(gateway, "squeezeserve_gateway_rejections_total", reason="model_not_found") == 1
    assert metric(gateway, "squeezeserve_gateway_upstream_healthy", upstream=upstream.url) == 1
    assert metric(gateway, "squeezeserve_gateway_upstream_in_flight", upstream=upstream.url) == 0


def test_each_app_has_its_own_registry(fake_upstream, start_gateway, openai_client, metric):
    upstream = fake_upstream()
    first, second = start_gateway([upstream.url]), start_gateway([upstream.url])

    openai_client(first).completions.create(model="fake-model", prompt="x")

    sample = "squeezeserve_gateway_requests_total"
    assert metric(first, sample, route=COMPLETIONS, model="fake-model", status="200") == 1
    assert metric(second, sample, route=COMPLETIONS, model="fake-model", status="200") == 0
