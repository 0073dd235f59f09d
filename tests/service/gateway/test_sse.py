"""What the gateway's TTFT waits for (``sse.has_content``): generated content, not a role or a usage block."""

from __future__ import annotations

from squeezeserve.service.gateway import sse


def test_a_completion_step_is_content_even_where_its_text_is_empty():
    # vLLM and our worker stream a chunk a step; a token that ends inside a character prints nothing yet
    assert sse.has_content({"choices": [{"index": 0, "text": "", "finish_reason": None}]})
    assert sse.has_content({"choices": [{"index": 0, "text": " Paris", "finish_reason": None}]})


def test_a_chat_role_chunk_and_a_usage_chunk_are_not_content():
    assert not sse.has_content({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    assert not sse.has_content({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})
    assert not sse.has_content({"choices": ["not a choice"]})
    assert sse.has_content({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})
    assert sse.has_content({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]})
