"""OpenAI response and stream-chunk shapes built from engine events."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from squeezeserve.service.worker.local.sampling import TokenLogprob


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class TokenText:
    """Token id -> the text OpenAI shows for it (cached: logprobs ask for the same ids again and again)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode(
                [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            self._cache[token_id] = text
        return text


@dataclass
class CompletionLogprobs:
    """The legacy completions ``logprobs`` object, grown token by token."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, entry: TokenLogprob | None, token_id: int, token_text: TokenText, offset: int) -> int:
        text = token_text(token_id)
        self.tokens.append(text)
        self.text_offset.append(offset)
        if entry is None:
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
        else:
            self.token_logprobs.append(entry.logprob)
            top = {token_text(t): lp for t, lp in entry.top}
            top.setdefault(text, entry.logprob)
            self.top_logprobs.append(top)
        return offset + len(text)

    def as_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def chat_logprob_entries(entries: list[TokenLogprob], token_text: TokenText) -> list[dict]:
    def one(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


def chunk(
    object_: str, rid: str, created: int, model: str, choices: list[dict], usage_: dict | None = None
) -> dict:
    """One streamed chunk: ``object_`` is "text_completion" or "chat.completion.chunk"."""
    out: dict[str, Any] = {
        "id": rid,
        "object": object_,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        out["usage"] = usage_
    return out


def now() -> int:
    return int(time.time())
