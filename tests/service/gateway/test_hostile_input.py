"""Bodies built to break the gateway get OpenAI-shaped 4xx, never a 5xx: oversized (413, whether its
length is declared or not), not UTF-8, and ``n`` / ``logprobs`` / ``stop`` at absurd values (400)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

LIMIT = 64 * 1024


@pytest.fixture
def gateway(fake_upstream: Callable[..., Any], start_gateway: Callable[..., str]) -> str:
    return start_gateway([fake_upstream().url], max_body_bytes=LIMIT)


def _assert_openai_error(answer: httpx.Response, status: int, code: str) -> None:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code


def test_an_oversized_body_gets_413(gateway: str) -> None:
    body = orjson.dumps({"model": "fake-model", "prompt": "x" * LIMIT})
    answer = httpx.post(
        f"{gateway}/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    _assert_openai_error(answer, 413, "request_too_large")


def test_an_oversized_body_without_a_length_gets_413(gateway: str) -> None:
    def chunks() -> Iterator[bytes]:  # sent chunked: the limit is found while reading
        yield b'{"model": "fake-model", "prompt": "'
        for _ in range(LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    answer = httpx.post(f"{gateway}/v1/completions", content=chunks())
    _assert_openai_error(answer, 413, "request_too_large")


def test_a_body_at_the_limit_is_served(gateway: str) -> None:
    body = {"model": "fake-model", "prompt": ""}
    body["prompt"] = "x" * (LIMIT - len(orjson.dumps(body)))
    raw = orjson.dumps(body)
    assert len(raw) == LIMIT
    answer = httpx.post(
        f"{gateway}/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 200, answer.text


def test_invalid_utf8_gets_400(gateway: str) -> None:
    raw = b'{"model": "fake-model", "prompt": "\xff\xfe caf\xc3"}'
    answer = httpx.post(
        f"{gateway}/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    _assert_openai_error(answer, 400, "invalid_request")


@pytest.mark.parametrize(
    "fields",
    [
        {"n": 10**9},
        {"n": -1},
        {"logprobs": 10**9},
        {"stop": ["x"] * 10_000},
        {"stop": "x" * 50_000},
        {"n": 1e308},
    ],
    ids=["n-huge", "n-negative", "logprobs-huge", "stop-many", "stop-long", "n-float"],
)
def test_absurd_values_get_400(gateway: str, fields: dict[str, Any]) -> None:
    body = {"model": "fake-model", "prompt": "hi", **fields}
    answer = httpx.post(
        f"{gateway}/v1/completions", content=orjson.dumps(body), headers={"content-type": "application/json"}
    )
    _assert_openai_error(answer, 400, "invalid_request")


@pytest.mark.slow  # loads the model
def test_a_prompt_far_beyond_the_context_gets_400(worker_gateway: str) -> None:
    body = {"model": "smollm2-135m-instruct", "prompt": "word " * 200_000, "max_tokens": 1}
    answer = httpx.post(f"{worker_gateway}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 400, answer.text
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
