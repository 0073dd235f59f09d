"""Upstreams dying, coming back and clients leaving: the gateway answers fast and keeps its books."""

from __future__ import annotations

import signal
import time

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # starts servers


def test_upstream_killed_mid_test_gives_503_not_a_hang(fake_process, start_gateway, openai_client):
    url, process = fake_process()
    gateway = start_gateway([url])
    client = openai_client(gateway, timeout=10.0)
    assert client.completions.create(model="fake-model", prompt="x").choices

    process.send_signal(signal.SIGKILL)
    process.wait()
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="fake-model", prompt="x")

    assert caught.value.status_code == 503
    assert caught.value.response.json()["error"]["code"] == "no_healthy_upstream"
    assert time.monotonic() - started < 5, "a dead upstream must be answered at once, not waited for"
    assert httpx.get(f"{gateway}/readyz").status_code == 503  # ejected: not ready until it comes back


def test_upstream_killed_mid_stream_ends_the_stream_with_an_error(fake_process, start_gateway, openai_client):
    url, process = fake_process()
    client = openai_client(start_gateway([url]), timeout=10.0)
    stream = client.completions.create(
        model="fake-model", prompt="x", stream=True, extra_body={"fake": {"hang_after": 1}}
    )
    first = next(iter(stream))
    assert first.choices[0].text == "w0 "

    process.send_signal(signal.SIGKILL)
    with pytest.raises(openai.APIError, match="broke off"):
        for _ in stream:
            pass


def test_connection_error_retries_once_on_a_live_upstream(
    fake_upstream, start_gateway, openai_client, metric
):
    dead, live = fake_upstream("dead"), fake_upstream("live")
    gateway = start_gateway([dead.url, live.url], routing="round_robin")
    dead.stop()  # still counted healthy: the health loop has not looked since
    client = openai_client(gateway)

    served = [client.completions.create(model="fake-model", prompt="x").system_fingerprint for _ in range(4)]

    assert served == ["live"] * 4
    # Round robin sent the first or second request to the dead one; that one retry ejected it for good.
    assert metric(gateway, "squeezeserve_gateway_upstream_retries_total", upstream=dead.url) == 1
    assert metric(gateway, "squeezeserve_gateway_upstream_healthy", upstream=dead.url) == 0


def test_health_checks_eject_after_n_failures_and_readmit(
    fake_upstream, start_gateway, eventually, openai_client
):
    flaky, steady = fake_upstream("flaky"), fake_upstream("steady")
    gateway = start_gateway(
        [flaky.url, steady.url], health_interval=0.05, unhealthy_threshold=3, routing="round_robin"
    )
    client = openai_client(gateway)

    flaky.app.state.healthy = False
    eventually(lambda: httpx.get(f"{gateway}/readyz").json()["healthy_upstreams"] == 1)
    served_while_out = {
        client.completions.create(model="fake-model", prompt="x").system_fingerprint for _ in range(4)
    }
    flaky.app.state.healthy = True
    eventually(lambda: httpx.get(f"{gateway}/readyz").json()["healthy_upstreams"] == 2)
    served_after = {
        client.completions.create(model="fake-model", prompt="x").system_fingerprint for _ in range(4)
    }

    assert served_while_out == {"steady"}
    assert served_after == {"flaky", "steady"}


def test_readiness_follows_the_upstreams(fake_upstream, start_gateway, eventually):
    upstream = fake_upstream()
    gateway = start_gateway([upstream.url], health_interval=0.05, unhealthy_threshold=1)
    assert httpx.get(f"{gateway}/readyz").status_code == 200

    upstream.app.state.healthy = False
    eventually(lambda: httpx.get(f"{gateway}/readyz").status_code == 503)

    assert httpx.get(f"{gateway}/health").status_code == 503
    assert httpx.get(f"{gateway}/readyz").json()["error"]["code"] == "no_healthy_upstream"
    assert httpx.get(f"{gateway}/livez").status_code == 200  # the process itself is fine


def test_no_upstream_reachable_at_start_is_503_for_any_model(start_gateway, openai_client):
    gateway = start_gateway(["http://127.0.0.1:9"])  # the discard port: nothing listens

    with pytest.raises(openai.APIStatusError) as caught:
        openai_client(gateway).completions.create(model="anything", prompt="x")

    assert caught.value.status_code == 503
    assert httpx.get(f"{gateway}/livez").status_code == 200


def test_client_leaving_a_stream_closes_the_upstream_stream(fake_upstream, start_gateway, eventually, metric):
    upstream = fake_upstream()
    gateway = start_gateway([upstream.url])
    body = {"model": "fake-model", "prompt": "x", "stream": True, "fake": {"hang_after": 1}}

    with httpx.stream("POST", f"{gateway}/v1/completions", json=body) as response:
        first = next(response.iter_lines())
        assert first.startswith("data: ")
    # The client is gone; the worker must hear of it (and stop generating), and the slot must be free.

    eventually(lambda: upstream.app.state.cancelled_streams == 1)
    eventually(lambda: metric(gateway, "squeezeserve_gateway_upstream_in_flight", upstream=upstream.url) == 0)


def test_requests_on_a_frozen_upstream_fail_over_when_its_health_check_times_out(
    fake_process, start_gateway, openai_client, metric
):
    (frozen_url, frozen), (live_url, _) = fake_process(), fake_process()
    gateway = start_gateway(
        [frozen_url, live_url],
        routing="round_robin",
        health_interval=0.2,
        health_timeout=0.5,
        unhealthy_threshold=1,
        request_timeout=60,
    )
    client = openai_client(gateway, timeout=30.0)
    frozen.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        # Round robin sends one of the two to the frozen one; it waits there until the gateway cuts it.
        replies = [client.completions.create(model="fake-model", prompt="x") for _ in range(2)]
        elapsed = time.monotonic() - started
    finally:
        frozen.send_signal(signal.SIGCONT)

    assert [reply.choices[0].text for reply in replies] == ["w0 w1 w2 "] * 2  # none lost
    assert metric(gateway, "squeezeserve_gateway_upstream_retries_total", upstream=frozen_url) == 1
    assert elapsed < 5, "the request on the frozen upstream must fail over well before its 60 s deadline"
