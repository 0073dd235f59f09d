"""Completion and chat responses built from engine events, collected into one JSON body or streamed as
SSE chunks. The event loop (folding events into choices, errors, timing, usage, the closing chunks) is
written once in :class:`ResponseBuilder`; the two APIs differ only in how a choice looks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from squeezeserve.service.errors import APIError, server_error
from squeezeserve.service.protocol import ChatCompletionRequest, CompletionRequest
from squeezeserve.service.serving import CLIENT_CLOSED_REQUEST, ClientGone, unless_gone, until_disconnected
from squeezeserve.service.worker.local import openai_format as fmt
from squeezeserve.service.worker.local.engine import Event
from squeezeserve.service.worker.local.engine import Request as EngineRequest
from squeezeserve.service.worker.local.service import WorkerService


@dataclass
class Choice:
    """One choice as it grows: its text pieces, token count, finish reason and logprobs."""

    text: list[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: fmt.CompletionLogprobs | None = None
    chat_logprobs: list = field(default_factory=list)
    offset: int = 0


class _Timing:
    """TTFT, TPOT, end-to-end latency and token counts of one request, into the worker's metrics."""

    def __init__(self, service: WorkerService, start: float) -> None:
        self.service, self.start, self.first = service, start, None
        self.tokens = 0

    def saw(self, event: Event) -> None:
        if event.token_ids:
            if self.first is None:
                self.first = time.perf_counter()
                self.service.metrics.ttft.observe(self.first - self.start)
            self.tokens += len(event.token_ids)

    def done(self, prompt_tokens: int) -> None:
        m = self.service.metrics
        end = time.perf_counter()
        m.e2e.observe(end - self.start)
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(self.tokens)
        if self.first is not None and self.tokens > 1:
            m.tpot.observe((end - self.first) / (self.tokens - 1))


async def _events(request: EngineRequest) -> AsyncIterator[Event]:
    """Yield engine events until every sequence of the request has finished."""
    remaining = request.size
    try:
        while remaining:
            for event in await request.queue.get():
                if event.finish_reason is not None:
                    remaining -= 1
                yield event
    finally:
        if remaining:
            request.cancel()


class ResponseBuilder:
    """One request's answer. Subclasses say how an event changes a choice and how choices look."""

    object: str  # of the collected response
    chunk_object: str  # of each streamed chunk
    id_prefix: str

    def __init__(
        self, service: WorkerService, body: Any, prompt_tokens: int, request: EngineRequest, start: float
    ) -> None:
        self.service, self.body, self.request = service, body, request
        self.prompt_tokens = prompt_tokens
        self.timing = _Timing(service, start)
        self.id = fmt.new_id(self.id_prefix)
        self.created = fmt.now()

    def fold(self, choice: Choice, event: Event) -> dict | None:
        """Fold ``event`` into ``choice``; return the streamed choice it adds, or None if nothing shows."""
        raise NotImplementedError

    def collected(self, index: int, choice: Choice) -> dict:
        """The finished choice in the collected response."""
        raise NotImplementedError

    def opening(self, index: int) -> dict | None:
        """A streamed choice sent before any event (chat announces the role), or None."""
        return None

    def _apply(self, choice: Choice, event: Event) -> dict | None:
        if event.error:
            raise server_error(event.error, "engine_error")
        streamed = self.fold(choice, event)
        choice.tokens += len(event.token_ids)
        if event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
        self.timing.saw(event)
        return streamed

    def _usage(self, choices: dict[int, Choice]) -> dict:
        return fmt.usage(self.prompt_tokens, sum(c.tokens for c in choices.values()))

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> bytes:
        return fmt.sse(fmt.chunk(self.chunk_object, self.id, self.created, self.body.model, choices, usage))

    async def collect(self) -> dict:
        choices = {i: Choice() for i in range(self.request.size)}
        async for event in _events(self.request):
            self._apply(choices[event.index], event)
        self.timing.done(self.prompt_tokens)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.body.model,
            "choices": [self.collected(i, c) for i, c in sorted(choices.items())],
            "usage": self._usage(choices),
        }

    async def stream(self) -> AsyncIterator[bytes]:
        choices = {i: Choice() for i in range(self.request.size)}
        for i in choices:
            first = self.opening(i)
            if first is not None:
                yield self._chunk([first])
        try:
            async for event in _events(self.request):
                streamed = self._apply(choices[event.index], event)
                if streamed is not None:
                    yield self._chunk([streamed])
        except APIError as exc:
            yield fmt.sse(exc.body())
            return
        self.timing.done(self.prompt_tokens)
        if self.body.include_usage_in_stream:
            yield self._chunk([], self._usage(choices))
        yield fmt.sse("[DONE]")


class CompletionResponse(ResponseBuilder):
    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl"
    body: CompletionRequest

    def __init__(
        self,
        service: WorkerService,
        body: CompletionRequest,
        prompts: list[list[int]],
        request: EngineRequest,
        start: float,
    ) -> None:
        super().__init__(service, body, sum(len(p) for p in prompts), request, start)
        self.prompts = prompts
        self.raw_prompts = body.prompts()

    def _prompt_text(self, p: int) -> str:
        raw = self.raw_prompts[p]
        return raw if isinstance(raw, str) else self.service.tokenizer.decode(raw)

    def fold(self, choice: Choice, event: Event) -> dict | None:
        text = ""
        new_lp = fmt.CompletionLogprobs() if self.body.logprobs is not None else None
        if event.first and self.body.echo:
            p = event.index // self.body.n
            text = self._prompt_text(p)
            if new_lp is not None and event.prompt_logprobs is not None:
                for tid, entry in zip(self.prompts[p], event.prompt_logprobs, strict=True):
                    choice.offset = new_lp.add(entry, tid, self.service.token_text, choice.offset)
        text += event.text
        if new_lp is not None:
            for entry in event.logprobs:
                choice.offset = new_lp.add(entry, entry.token_id, self.service.token_text, choice.offset)
            if choice.logprobs is None:
                choice.logprobs = fmt.CompletionLogprobs()
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(choice.logprobs, name).extend(getattr(new_lp, name))
        choice.text.append(text)
        if not text and event.finish_reason is None and not event.token_ids:
            return None
        return {
            "index": event.index,
            "text": text,
            "logprobs": new_lp.as_dict() if new_lp is not None else None,
            "finish_reason": event.finish_reason,
        }

    def collected(self, index: int, choice: Choice) -> dict:
        return {
            "index": index,
            "text": "".join(choice.text),
            "logprobs": choice.logprobs.as_dict() if choice.logprobs is not None else None,
            "finish_reason": choice.finish_reason,
        }


class ChatResponse(ResponseBuilder):
    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"
    body: ChatCompletionRequest

    def fold(self, choice: Choice, event: Event) -> dict | None:
        choice.text.append(event.text)
        entries = (
            fmt.chat_logprob_entries(event.logprobs, self.service.token_text) if self.body.logprobs else []
        )
        choice.chat_logprobs.extend(entries)
        if not event.text and event.finish_reason is None and not entries:
            return None
        return {
            "index": event.index,
            "delta": {"content": event.text} if event.text else {},
            "logprobs": {"content": entries} if self.body.logprobs else None,
            "finish_reason": event.finish_reason,
        }

    def opening(self, index: int) -> dict | None:
        role = {"role": "assistant", "content": ""}
        return {"index": index, "delta": role, "logprobs": None, "finish_reason": None}

    def collected(self, index: int, choice: Choice) -> dict:
        return {
            "index": index,
            "message": {"role": "assistant", "content": "".join(choice.text)},
            "logprobs": {"content": choice.chat_logprobs} if self.body.logprobs else None,
            "finish_reason": choice.finish_reason,
        }


class _EngineStream(StreamingResponse):
    """An SSE response that cancels its engine request however the response ends.

    When the client hangs up, Starlette stops iterating the body without closing the generator, whose own
    cleanup then waits for garbage collection; cancelling here stops generation at the next engine step.
    """

    def __init__(self, chunks: AsyncIterator[bytes], request: EngineRequest) -> None:
        super().__init__(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._engine_request = request

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine_request.cancel()  # a no-op for the engine once every sequence has finished


async def respond(http: Request, builder: ResponseBuilder, stream: bool) -> Response:
    """The answer to ``http``: streamed as SSE, or collected. A collected request whose client goes away
    first is cancelled and left: the engine drops cancelled sequences without a last event, so waiting for
    the collection would hold the handler (and the drain's in-flight count) forever."""
    metrics = builder.service.metrics
    if stream:
        metrics.requests.labels(endpoint=http.url.path, status="200").inc()
        return _EngineStream(builder.stream(), builder.request)
    try:
        body = await unless_gone(builder.collect(), lambda: until_disconnected(http.receive))
    except ClientGone:
        builder.request.cancel()
        metrics.requests.labels(endpoint=http.url.path, status=str(CLIENT_CLOSED_REQUEST)).inc()
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    metrics.requests.labels(endpoint=http.url.path, status="200").inc()
    return JSONResponse(body)
