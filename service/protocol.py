"""The OpenAI request schemas both the gateway and the embedded worker accept.

The gateway validates bodies with these models (types and OpenAI's own ranges) and then forwards the
original bytes, so fields it does not know (vLLM's extras such as ``top_k``) pass through untouched:
``extra="allow"``. The embedded worker reads the fields it implements from the same models.

No torch here: the gateway imports this module.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# OpenAI's limit on stop sequences; their length is bounded too, so a body cannot make every decode step
# scan megabytes.
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 1024
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)] | None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's names, ranges and defaults)."""

    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(min_length=1)]
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Field(ge=1, le=64)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past end-of-sequence (benchmarks)

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


PromptTokens = list[int]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``. ``prompt`` is a string, a list of strings, token ids or lists of them."""

    prompt: str | list[str] | PromptTokens | list[PromptTokens]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error shape, used for every error either server returns; ``code`` is a string or null."""
    code = None if code is None else str(code)
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# pydantic names the union member that failed inside `loc` ("prompt", "list[str]", 0); those tags are not
# part of the field's path.
_SCALAR_TAGS = frozenset(
    {"str", "int", "float", "bool", "none", "constrained-int", "constrained-float", "constrained-str"}
)


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in _SCALAR_TAGS)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Turn pydantic's error list into one sentence naming the field, plus that field's name."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_union_tag(p)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if param:
        return f"Invalid value for '{param}': {msg}", param
    return f"Invalid request body: {msg}", None
