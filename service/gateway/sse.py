"""Server-sent events, as much as a relay needs: split a byte stream into events, read their JSON data.

Events end at a blank line (``\\n\\n``, ``\\r\\n\\r\\n`` or ``\\r\\r``: sse-starlette writes CRLF, vLLM LF).
The relay forwards each event's original bytes as soon as the event is complete.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE_END = re.compile(rb"\r\n|\n|\r")
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')

DONE = b"[DONE]"


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete events (each with its terminating blank line) and the incomplete rest of ``buffer``."""
    events = []
    start = 0
    for match in _EVENT_END.finditer(buffer):
        events.append(buffer[start : match.end()])
        start = match.end()
    return events, buffer[start:]


def event_data(event: bytes) -> bytes | None:
    """The event's ``data:`` lines joined by newlines, or None when it has none (a comment, a ping)."""
    lines = [line for line in _LINE_END.split(event) if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[5:].removeprefix(b" ") for line in lines)


def event_json(event: bytes) -> dict[str, Any] | None:
    """The event's data parsed as a JSON object; None for ``[DONE]``, non-data events or non-objects."""
    data = event_data(event)
    if data is None or data.strip() == DONE:
        return None
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def may_carry_usage(event: bytes) -> bool:
    """Whether the event's data may hold a ``usage`` object (a cheap byte search, no JSON parsing)."""
    return _USAGE_OBJECT.search(event) is not None


def error_event(body: dict[str, Any]) -> bytes:
    """An error as an SSE event: OpenAI's SDK raises it as an APIError when it reads it mid-stream."""
    return b"data: " + orjson.dumps(body) + b"\n\n"


def has_content(chunk: dict[str, Any]) -> bool:
    """Whether a completion or chat chunk carries generated content (not just a role or a usage block). A
    completion chunk's choice is a step's tokens even where its text is empty (a token that ends inside a
    multi-byte character, or one the server does not print), as the load generator counts it."""
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if isinstance(choice.get("text"), str):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(
            delta.get(k) for k in ("content", "reasoning_content", "tool_calls")
        ):
            return True
    return False


def is_usage_only(chunk: dict[str, Any]) -> bool:
    """OpenAI's final usage chunk: no choices, a usage object."""
    return not chunk.get("choices") and isinstance(chunk.get("usage"), dict)
