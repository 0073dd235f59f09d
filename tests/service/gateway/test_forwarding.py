"""Requests through the gateway with the official client: answers, streams, headers, pass-through."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow  # starts servers


def test_completion_and_chat_answer(fake_upstream, start_gateway, openai_client):
    upstream = fake_upstream("a")
    client = openai_client(start_gateway([upstream.url]))

    completion = client.completions.create(model="fake-model", prompt="hello there", max_tokens=3)
    chat = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])

    assert completion.choices[0].text == "w0 w1 w2 "
    assert completion.usage.completion_tokens == 3
    assert chat.choices[0].message.content == "w0 w1 w2 "


def test_streams_relay_every_chunk_and_drop_the_usage_chunk_nobody_asked_for(
    fake_upstream, start_gateway, openai_client
):
    upstream = fake_upstream("a")
    client = openai_client(start_gateway([upstream.url]))

    chunks = list(client.completions.create(model="fake-model", prompt="p", stream=True))
    chat_chunks = list(
        client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            extra_body={"fake": {"chunks": 5}},
        )
    )

    assert "".join(c.choices[0].text for c in chunks) == "w0 w1 w2 "
    assert all(c.choices for c in chunks), "the gateway's own usage chunk must not reach this client"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == "w0 w1 w2 w3 w4 "
    # The gateway asked the upstream for usage (for its metrics) although the client did not.
    assert upstream.app.state.received[0]["body"]["stream_options"] == {"include_usage": True}


def test_stream_usage_reaches_a_client_that_asked(fake_upstream, start_gateway, openai_client):
    client = openai_client(start_gateway([fake_upstream("a").url]))

    chunks = list(
        client.completions.create(
            model="fake-model", prompt="a b c", stream=True, stream_options={"include_usage": True}
        )
    )

    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == 3


def test_original_body_and_unknown_fields_reach_the_upstream(fake_upstream, start_gateway):
    upstream = fake_upstream("a")
    gateway = start_gateway([upstream.url])
    body = b'{"model": "fake-model", "prompt": "x",   "top_k": 7, "vendor_extra": {"nested": [1, 2]}}'

    response = httpx.post(
        f"{gateway}/v1/completions", content=body, headers={"content-type": "application/json"}
    )

    assert response.status_code == 200
    assert upstream.app.state.received[0]["body"] == json.loads(body)


def test_the_original_bytes_are_forwarded_both_ways(fake_upstream, start_gateway):
    upstream = fake_upstream()
    gateway = start_gateway([upstream.url])
    # Spacing, key order and escapes that any re-serialisation would change.
    body = b'{ "prompt" : "caf\\u00e9\\n",\n"model":"fake-model", "max_tokens": 1.0e1, "x": [ ] }'

    through_gateway = httpx.post(
        f"{gateway}/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    direct = httpx.post(f"{upstream.url}/v1/completions", content=body)

    assert through_gateway.status_code == 200
    assert upstream.app.state.received[0]["raw"] == body
    # The answer comes back as the upstream wrote it (only its id and timestamp differ between the two).
    assert len(through_gateway.content) == len(direct.content)
    assert through_gateway.content.startswith(b'{"id":"cmpl-')


def test_upstream_connections_are_kept_alive(fake_upstream, start_gateway, openai_client):
    upstream = fake_upstream()
    client = openai_client(start_gateway([upstream.url]))

    for _ in range(3):
        client.completions.create(model="fake-model", prompt="x")
    for _ in client.completions.create(model="fake-model", prompt="x", stream=True):
        pass
    client.completions.create(model="fake-model", prompt="x")

    assert len({request["peer_port"] for request in upstream.app.state.received}) == 1


def test_request_id_is_passed_through_upstream_and_back(fake_upstream, start_gateway, openai_client):
    upstream = fake_upstream("a")
    gateway = start_gateway([upstream.url])
    client = openai_client(gateway)

    raw = client.completions.with_raw_response.create(
        model="fake-model", prompt="x", extra_headers={"X-Request-Id": "trace-123"}
    )
    created = httpx.post(f"{gateway}/v1/completions", json={"model": "fake-model", "prompt": "x"})

    assert raw.headers["x-request-id"] == "trace-123"
    assert upstream.app.state.received[0]["headers"]["x-request-id"] == "trace-123"
    made = created.headers["x-request-id"]
    assert len(made) == 32 and made != "trace-123"
    assert upstream.app.state.received[1]["headers"]["x-request-id"] == made


def test_hop_by_hop_headers_and_client_credentials_are_not_forwarded(fake_upstream, start_gateway):
    upstream = fake_upstream("a")
    gateway = start_gateway([upstream.url], api_keys=["k1"])
    headers = {"Authorization": "Bearer k1", "Connection": "keep-alive, X-Secret-Hop", "X-Secret-Hop": "1"}
    headers["Proxy-Authorization"] = "Basic abc"
    headers["X-Custom"] = "kept"

    response = httpx.post(
        f"{gateway}/v1/completions", json={"model": "fake-model", "prompt": "x"}, headers=headers
    )

    assert response.status_code == 200
    sent = upstream.app.state.received[0]["headers"]
    assert sent["x-custom"] == "kept"
    for name in ("authorization", "proxy-authorization", "x-secret-hop"):
        assert name not in sent
    assert sent.get("connection", "keep-alive") == "keep-alive"  # httpx's own, not the client's list


def test_upstream_errors_pass_through_with_their_status(fake_upstream, start_gateway):
    client_url = start_gateway([fake_upstream("a").url])

    json_error = httpx.post(
        f"{client_url}/v1/completions", json={"model": "fake-model", "prompt": "x", "fake": {"status": 422}}
    )
    text_error = httpx.post(
        f"{client_url}/v1/completions",
        json={"model": "fake-model", "prompt": "x", "fake": {"status": 500, "raw_error": True}},
    )

    assert json_error.status_code == 422
    assert json_error.json()["error"]["message"] == "fake error 422"
    assert text_error.status_code == 500
    assert text_error.json()["error"]["type"] == "upstream_error"
    assert "upstream exploded" in text_error.json()["error"]["message"]


def test_eight_concurrent_requests_all_complete(fake_upstream, start_gateway, openai_client):
    upstreams = [fake_upstream("a"), fake_upstream("b")]
    client = openai_client(start_gateway([u.url for u in upstreams]))

    def one(i: int) -> str:
        if i % 2:
            chunks = client.completions.create(
                model="fake-model", prompt=f"p{i}", stream=True, extra_body={"fake": {"chunk_delay": 0.05}}
            )
            return "".join(c.choices[0].text for c in chunks)
        return (
            client.completions.create(model="fake-model", prompt=f"p{i}", extra_body={"fake": {"delay": 0.2}})
            .choices[0]
            .text
        )

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(8)))

    assert texts == ["w0 w1 w2 "] * 8
    assert sum(len(u.app.state.received) for u in upstreams) == 8


def test_models_lists_the_union_of_healthy_upstreams(fake_upstream, start_gateway, openai_client):
    a = fake_upstream("a", ["m1", "shared"])
    b = fake_upstream("b", ["m2", "shared"])
    client = openai_client(start_gateway([a.url, b.url]))

    ids = sorted(model.id for model in client.models.list())

    assert ids == ["m1", "m2", "shared"]


def test_requests_route_by_model(fake_upstream, start_gateway, openai_client):
    a = fake_upstream("a", ["m1"])
    b = fake_upstream("b", ["m2"])
    client = openai_client(start_gateway([a.url, b.url]))

    served = {
        m: {client.completions.create(model=m, prompt="x").system_fingerprint for _ in range(4)}
        for m in ("m1", "m2")
    }

    assert served == {"m1": {"a"}, "m2": {"b"}}
