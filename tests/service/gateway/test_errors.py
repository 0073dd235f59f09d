"""Every failure comes back OpenAI-shaped with the right status, through the official client."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # starts servers


def assert_openai_error(body: dict, type_: str, code: str | None) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    assert body["error"]["type"] == type_
    assert body["error"]["code"] == code


def test_unknown_model_is_404_model_not_found(fake_upstream, start_gateway, openai_client):
    client = openai_client(start_gateway([fake_upstream().url]))

    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])

    assert caught.value.status_code == 404
    assert_openai_error(caught.value.response.json(), "invalid_request_error", "model_not_found")
    assert caught.value.response.json()["error"]["param"] == "model"


def test_malformed_json_is_400(fake_upstream, start_gateway):
    gateway = start_gateway([fake_upstream().url])

    response = httpx.post(
        f"{gateway}/v1/completions",
        content=b'{"model": "fake-model", "prompt": ',
        headers={"content-type": "application/json"},
    )

    assert response.status_code == 400
    assert_openai_error(response.json(), "invalid_request_error", "invalid_request")
    assert "JSON" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "fake-model", "prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"model": "fake-model", "prompt": "x", "temperature": 9}, "temperature"),
        ({"model": "", "prompt": "x"}, "model"),
        ({"model": "fake-model", "messages": "hi"}, "messages"),
    ],
)
def test_wrong_types_are_400_naming_the_field(fake_upstream, start_gateway, openai_client, body, param):
    client = openai_client(start_gateway([fake_upstream().url]))
    route = client.chat.completions if "messages" in body else client.completions

    with pytest.raises(openai.BadRequestError) as caught:
        route.create(**body)  # the client sends what it is given; the gateway must check

    error = caught.value.response.json()
    assert_openai_error(error, "invalid_request_error", "invalid_request")
    assert error["error"]["param"].split(".")[0] == param
    assert param in error["error"]["message"]


def test_non_object_body_is_400(fake_upstream, start_gateway):
    gateway = start_gateway([fake_upstream().url])

    response = httpx.post(f"{gateway}/v1/chat/completions", json=["model"])

    assert response.status_code == 400
    assert_openai_error(response.json(), "invalid_request_error", "invalid_request")


def test_keys_configured_401_without_or_with_a_wrong_one(fake_upstream, start_gateway, openai_client):
    gateway = start_gateway([fake_upstream().url], api_keys=["k1", "k2"])

    for key in ("wrong", "k1x"):
        with pytest.raises(openai.AuthenticationError) as caught:
            openai_client(gateway, api_key=key).models.list()
        assert_openai_error(caught.value.response.json(), "invalid_request_error", "invalid_api_key")
    no_header = httpx.post(f"{gateway}/v1/completions", json={"model": "fake-model", "prompt": "x"})

    assert no_header.status_code == 401
    assert openai_client(gateway, api_key="k2").completions.create(model="fake-model", prompt="x").choices
    # Probes and metrics stay open for the orchestrator and the scraper.
    for path in ("/livez", "/readyz", "/health", "/metrics"):
        assert httpx.get(f"{gateway}{path}").status_code == 200


def test_timeout_is_504_and_frees_the_slot(fake_upstream, start_gateway, openai_client, metric):
    upstream = fake_upstream()
    gateway = start_gateway([upstream.url], request_timeout=0.5)
    client = openai_client(gateway)

    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="fake-model", prompt="x", extra_body={"fake": {"delay": 1.5}})

    assert caught.value.status_code == 504
    assert_openai_error(caught.value.response.json(), "timeout", "upstream_timeout")
    assert metric(gateway, "squeezeserve_gateway_upstream_in_flight", upstream=upstream.url) == 0


def test_timeout_mid_stream_ends_the_stream_with_an_error_event(fake_upstream, start_gateway, openai_client):
    client = openai_client(start_gateway([fake_upstream().url], request_timeout=1.0))
    stream = client.completions.create(
        model="fake-model", prompt="x", stream=True, extra_body={"fake": {"hang_after": 1}}
    )

    with pytest.raises(openai.APIError, match="did not answer"):
        for _ in stream:
            pass


def test_every_upstream_at_its_limit_is_429_with_retry_after(
    fake_upstream, start_gateway, openai_client, metric, eventually
):
    gateway = start_gateway([fake_upstream().url], max_inflight_per_upstream=1, retry_after_seconds=3)
    client = openai_client(gateway)

    def slow() -> None:
        client.completions.create(model="fake-model", prompt="x", extra_body={"fake": {"delay": 1}})

    background = threading.Thread(target=slow)
    background.start()
    # Wait until the gateway holds the slow request, so the next one must be refused.
    eventually(lambda: metric(gateway, "squeezeserve_gateway_upstream_in_flight") == 1)

    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model="fake-model", prompt="x")
    background.join()

    assert caught.value.response.headers["retry-after"] == "3"
    assert_openai_error(caught.value.response.json(), "rate_limit_error", "rate_limit_exceeded")
    # Once the slow one is done, the slot is free again.
    assert client.completions.create(model="fake-model", prompt="x").choices


def test_unknown_path_and_wrong_method_are_openai_shaped_with_string_codes(fake_upstream, start_gateway):
    gateway = start_gateway([fake_upstream().url])
    missing = httpx.get(f"{gateway}/v1/nothing")
    wrong_method = httpx.delete(f"{gateway}/v1/completions")

    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert missing.json()["error"]["type"] == "invalid_request_error"
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"


def test_a_rejected_request_is_logged_with_the_model_it_asked_for(fake_upstream, start_gateway, caplog):
    gateway = start_gateway([fake_upstream().url], api_keys=["k"])
    with caplog.at_level("INFO", logger="squeezeserve.service.gateway.errors"):
        unknown = httpx.post(
            f"{gateway}/v1/completions",
            json={"model": "no-such-model", "prompt": "secret prompt"},
            headers={"Authorization": "Bearer k"},
        )
        unauthorized = httpx.post(f"{gateway}/v1/completions", json={"model": "m", "prompt": "x"})

    assert unknown.status_code == 404 and unauthorized.status_code == 401
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rejected")]
    assert any("model='no-such-model'" in line and "status=404" in line for line in lines), lines
    assert not any("secret prompt" in line or "Bearer" in line for line in lines)


def test_one_model_card_by_id(fake_upstream, start_gateway, openai_client):
    client = openai_client(start_gateway([fake_upstream("a", ["org/model-1", "m2"]).url]))

    assert client.models.retrieve("org/model-1").id == "org/model-1"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("nope")
    assert err.value.body["code"] == "model_not_found"


def test_docs_work_offline(fake_upstream, start_gateway):
    gateway = start_gateway([fake_upstream().url])
    page = httpx.get(f"{gateway}/docs")

    assert (
        page.status_code == 200 and "cdn." not in page.text and "https://" not in page.text.split("<body")[0]
    )
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        assert f"/docs/assets/{asset}" in page.text
        assert httpx.get(f"{gateway}/docs/assets/{asset}").status_code == 200
    assert httpx.get(f"{gateway}/redoc").status_code == 404  # its scripts would come from a CDN
