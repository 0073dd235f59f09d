"""The gateway in front of the real embedded worker (bundled model on CPU), through the official client."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow  # loads the model

MODEL = "smollm2-135m-instruct"  # the name tests/conftest.py serves the baseline under


@pytest.fixture(scope="module")
def client(worker_gateway: str) -> OpenAI:
    return OpenAI(base_url=f"{worker_gateway}/v1", api_key="unused", max_retries=0, timeout=120.0)


def test_models_come_from_the_worker(client):
    assert [model.id for model in client.models.list()] == [MODEL]


def test_chat_answers_paris(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=12,  # "The capital of France is Paris." is 8 tokens
    )

    assert "Paris" in reply.choices[0].message.content


def test_completion_streamed_equals_not_streamed(client):
    args = {"model": MODEL, "prompt": "The quick brown fox", "temperature": 0, "max_tokens": 8}

    whole = client.completions.create(**args).choices[0].text
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **args))

    assert whole
    assert streamed == whole  # greedy decoding: the same tokens either way


def test_chat_stream_returns_text(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, stream=True
        )
    )

    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert all(c.choices for c in chunks), "the usage chunk the gateway asked for must not reach the client"


def test_eight_concurrent_requests_complete(client):
    def one(i: int) -> str:
        return client.completions.create(model=MODEL, prompt=f"Number {i} is", max_tokens=2).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(8)))

    assert len(texts) == 8 and all(isinstance(t, str) for t in texts)


def test_metrics_count_the_workers_tokens(client, worker_gateway, metric):
    before = metric(worker_gateway, "squeezeserve_gateway_tokens_total", model=MODEL, direction="completion")
    for _ in client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, temperature=0, stream=True):
        pass

    after = metric(worker_gateway, "squeezeserve_gateway_tokens_total", model=MODEL, direction="completion")
    assert 1 <= after - before <= 5  # at most max_tokens; fewer only if the model stops early
    assert httpx.get(f"{worker_gateway}/readyz").status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_client_hanging_up_stops_the_worker(worker_gateway: str, baseline_worker: str, stream: bool) -> None:
    """A client that leaves mid-generation makes the gateway close its upstream request, and the worker
    drops the sequence instead of generating thousands of tokens for nobody."""
    body = {"model": MODEL, "prompt": "Write a very long essay.", "max_tokens": 4000, "stream": stream}
    body["ignore_eos"] = True  # sampling may otherwise pick end-of-sequence first and finish at once

    def running() -> float:
        for line in httpx.get(f"{baseline_worker}/metrics").text.splitlines():
            if line.startswith("squeezeserve_worker_num_requests_running "):
                return float(line.split()[1])
        raise AssertionError("worker metric missing")

    url = f"{worker_gateway}/v1/completions"
    if stream:
        with httpx.stream("POST", url, json=body, timeout=30) as response:
            next(response.iter_raw())  # generation is under way; leaving the block hangs up
    else:
        try:  # the client gives up before the answer is complete
            answer = httpx.post(url, json=body, timeout=1.5)
        except httpx.TimeoutException:
            pass
        else:
            pytest.fail(f"the request was answered: {answer.status_code} {answer.text[:300]}")
    deadline = time.monotonic() + 20
    while running() > 0:
        assert time.monotonic() < deadline, "the worker kept generating for a client that left"
        time.sleep(0.1)
