"""The embedded worker's OpenAI-compatible HTTP API over the engine.

Routes tokenize, check limits, submit one ``Request`` to the engine and turn its events into OpenAI
responses or SSE chunks. Generation runs on the engine thread, never on the event loop; a client that
disconnects cancels its request, and the engine drops it at the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from squeezeserve.service.apidocs import create_app_with_offline_docs
from squeezeserve.service.errors import APIError, install_error_handlers, invalid_request
from squeezeserve.service.models.loader import LoadedModel
from squeezeserve.service.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    validation_message,
)
from squeezeserve.service.worker.local import openai_format as fmt
from squeezeserve.service.worker.local.engine import Engine, EngineOverloaded, Event
from squeezeserve.service.worker.local.engine import Request as EngineRequest
from squeezeserve.service.worker.local.metrics import WorkerMetrics
from squeezeserve.service.worker.local.sampling import SamplingParams

_DISCONNECT_POLL_S = 0.25


def bad_request(message: str, param: str | None = None) -> APIError:
    return invalid_request(message, param)


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    logprobs: fmt.CompletionLogprobs | None = None
    chat_logprobs: list = field(default_factory=list)
    offset: int = 0


class WorkerService:
    """Holds what the routes share: the model, the engine and the metrics."""

    def __init__(self, loaded: LoadedModel, served_name: str, max_batch_size: int, max_waiting: int) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.served_name = served_name
        self.engine = Engine(
            loaded.model, loaded.tokenizer, loaded.eos_token_ids, max_batch_size, max_waiting
        )
        self.metrics = WorkerMetrics(self.engine.stats, served_name)
        self.token_text = fmt.TokenText(loaded.tokenizer)
        self.vocab_size = len(loaded.tokenizer)
        self.created = fmt.now()

    # -- request preparation ---------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.served_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist.",
                "invalid_request_error",
                "model_not_found",
                "model",
            )

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        else:
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise bad_request(
                    f"Token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1}).", "prompt"
                )
            ids = list(prompt)
        if not ids:
            raise bad_request("The prompt is empty.", "prompt")
        return ids

    def output_budget(self, prompt_lens: list[int], max_tokens: int | None, param: str) -> int:
        context = self.loaded.max_context
        longest = max(prompt_lens)
        if longest >= context:
            raise bad_request(
                f"The prompt has {longest} tokens; this model's context is {context} tokens.", "prompt"
            )
        if max_tokens is None:
            return context - longest
        if longest + max_tokens > context:
            raise bad_request(
                f"{param}={max_tokens} plus the prompt's {longest} tokens exceeds the model's context of "
                f"{context} tokens.",
                param,
            )
        return max_tokens

    def submit(self, prompts: list[list[int]], n: int, params: SamplingParams) -> EngineRequest:
        request = EngineRequest(prompts, n, params)
        try:
            self.engine.submit(request)
        except EngineOverloaded as exc:
            raise APIError(
                429,
                f"The worker is overloaded ({exc}); retry later.",
                "rate_limit_error",
                "overloaded",
                headers={"Retry-After": "1"},
            ) from exc
        return request


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


async def _cancel_on_disconnect(http: Request, request: EngineRequest) -> None:
    while not request.cancelled:
        if await http.is_disconnected():
            request.cancel()
            return
        await asyncio.sleep(_DISCONNECT_POLL_S)


async def _parse(http: Request, model: type[BaseModel]) -> Any:
    raw = await http.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise bad_request(message, param) from exc


class _Timing:
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


def create_app(
    loaded: LoadedModel, served_name: str, max_batch_size: int = 16, max_waiting: int = 256
) -> FastAPI:
    service = WorkerService(loaded, served_name, max_batch_size, max_waiting)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.engine.start()
        try:
            yield
        finally:
            service.engine.stop()

    app = create_app_with_offline_docs(title="squeezeserve embedded worker", lifespan=lifespan)
    app.state.service = service

    def _count(http: Request, error: APIError) -> None:
        service.metrics.requests.labels(endpoint=http.url.path, status=str(error.status)).inc()

    install_error_handlers(app, _count)

    @app.get("/health")
    async def health() -> Response:
        if not service.engine._thread.is_alive():
            return JSONResponse(error_body("engine thread is not running", "server_error"), status_code=503)
        return JSONResponse({"status": "ok", "model": served_name})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    card = {
        "id": served_name,
        "object": "model",
        "created": service.created,
        "owned_by": "squeezeserve",
        "root": loaded.path,
        "max_model_len": loaded.max_context,
    }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        service.check_model(model_id)
        return card

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        start = time.perf_counter()
        body: CompletionRequest = await _parse(http, CompletionRequest)
        service.check_model(body.model)
        prompts = [service.encode(p) for p in body.prompts()]
        max_tokens = service.output_budget([len(p) for p in prompts], body.max_tokens, "max_tokens")
        if body.echo and body.logprobs is not None:
            prompt_lp = body.logprobs
        else:
            prompt_lp = None
        params = _sampling(body, max_tokens, body.logprobs, prompt_lp)
        request = service.submit(prompts, body.n, params)
        ctx = _CompletionContext(service, body, prompts, request, start)
        if body.stream:
            return _stream(http, ctx.stream(), request, service)
        return await _collect(http, request, ctx.collect(), service)

    @app.post("/v1/chat/completions")
    async def chat(http: Request) -> Response:
        start = time.perf_counter()
        body: ChatCompletionRequest = await _parse(http, ChatCompletionRequest)
        service.check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = service.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # templates raise on roles or orders they do not support
            raise bad_request(f"The chat template rejected the messages: {exc}", "messages") from exc
        prompt = service.encode(text, add_special_tokens=False)
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = service.output_budget([len(prompt)], body.output_limit, param)
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = _sampling(body, max_tokens, top, None)
        request = service.submit([prompt], body.n, params)
        ctx = _ChatContext(service, body, prompt, request, start)
        if body.stream:
            return _stream(http, ctx.stream(), request, service)
        return await _collect(http, request, ctx.collect(), service)

    return app


def _sampling(
    body: Any, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None
) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=tuple(body.stop_strings),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        ignore_eos=body.ignore_eos,
    )


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


def _stream(
    http: Request, chunks: AsyncIterator[bytes], request: EngineRequest, service: WorkerService
) -> StreamingResponse:
    service.metrics.requests.labels(endpoint=http.url.path, status="200").inc()
    return _EngineStream(chunks, request)


async def _collect(http: Request, request: EngineRequest, result: Any, service: WorkerService) -> Response:
    watcher = asyncio.create_task(_cancel_on_disconnect(http, request))
    try:
        body = await result
    finally:
        watcher.cancel()
    service.metrics.requests.labels(endpoint=http.url.path, status="200").inc()
    return JSONResponse(body)


class _CompletionContext:
    def __init__(
        self,
        service: WorkerService,
        body: CompletionRequest,
        prompts: list[list[int]],
        request: EngineRequest,
        start: float,
    ) -> None:
        self.service, self.body, self.prompts, self.request = service, body, prompts, request
        self.timing = _Timing(service, start)
        self.id = fmt.new_id("cmpl")
        self.created = fmt.now()
        self.raw_prompts = body.prompts()

    def _prompt_text(self, p: int) -> str:
        raw = self.raw_prompts[p]
        return raw if isinstance(raw, str) else self.service.tokenizer.decode(raw)

    def _apply(self, choice: _Choice, event: Event) -> tuple[str, fmt.CompletionLogprobs | None]:
        """Fold one event into ``choice``; return the text and logprobs this event adds."""
        if event.error:
            raise APIError(500, event.error, "server_error", "engine_error")
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
        choice.text.append(text)
        choice.tokens += len(event.token_ids)
        if event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
        if new_lp is not None:
            if choice.logprobs is None:
                choice.logprobs = fmt.CompletionLogprobs()
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(choice.logprobs, name).extend(getattr(new_lp, name))
        self.timing.saw(event)
        return text, new_lp

    def _usage(self, choices: dict[int, _Choice]) -> dict:
        prompt_tokens = sum(len(p) for p in self.prompts)
        return fmt.usage(prompt_tokens, sum(c.tokens for c in choices.values()))

    async def collect(self) -> dict:
        choices = {i: _Choice() for i in range(self.request.size)}
        async for event in _events(self.request):
            self._apply(choices[event.index], event)
        self.timing.done(sum(len(p) for p in self.prompts))
        out = [
            {
                "index": i,
                "text": "".join(c.text),
                "logprobs": c.logprobs.as_dict() if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for i, c in sorted(choices.items())
        ]
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.body.model,
            "choices": out,
            "usage": self._usage(choices),
        }

    async def stream(self) -> AsyncIterator[bytes]:
        choices = {i: _Choice() for i in range(self.request.size)}
        try:
            async for event in _events(self.request):
                text, lp = self._apply(choices[event.index], event)
                if not text and event.finish_reason is None and not event.token_ids:
                    continue
                choice = {
                    "index": event.index,
                    "text": text,
                    "logprobs": lp.as_dict() if lp is not None else None,
                    "finish_reason": event.finish_reason,
                }
                yield fmt.sse(fmt.chunk("text_completion", self.id, self.created, self.body.model, [choice]))
        except APIError as exc:
            yield fmt.sse(error_body(str(exc), exc.type, exc.code))
            return
        self.timing.done(sum(len(p) for p in self.prompts))
        if self.body.include_usage_in_stream:
            yield fmt.sse(
                fmt.chunk("text_completion", self.id, self.created, self.body.model, [], self._usage(choices))
            )
        yield fmt.sse("[DONE]")


class _ChatContext:
    def __init__(
        self,
        service: WorkerService,
        body: ChatCompletionRequest,
        prompt: list[int],
        request: EngineRequest,
        start: float,
    ) -> None:
        self.service, self.body, self.prompt, self.request = service, body, prompt, request
        self.timing = _Timing(service, start)
        self.id = fmt.new_id("chatcmpl")
        self.created = fmt.now()

    def _apply(self, choice: _Choice, event: Event) -> list[dict]:
        if event.error:
            raise APIError(500, event.error, "server_error", "engine_error")
        choice.text.append(event.text)
        choice.tokens += len(event.token_ids)
        if event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
        entries = (
            fmt.chat_logprob_entries(event.logprobs, self.service.token_text) if self.body.logprobs else []
        )
        choice.chat_logprobs.extend(entries)
        self.timing.saw(event)
        return entries

    def _usage(self, choices: dict[int, _Choice]) -> dict:
        return fmt.usage(len(self.prompt), sum(c.tokens for c in choices.values()))

    async def collect(self) -> dict:
        choices = {i: _Choice() for i in range(self.request.size)}
        async for event in _events(self.request):
            self._apply(choices[event.index], event)
        self.timing.done(len(self.prompt))
        out = [
            {
                "index": i,
                "message": {"role": "assistant", "content": "".join(c.text)},
                "logprobs": {"content": c.chat_logprobs} if self.body.logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for i, c in sorted(choices.items())
        ]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.body.model,
            "choices": out,
            "usage": self._usage(choices),
        }

    async def stream(self) -> AsyncIterator[bytes]:
        choices = {i: _Choice() for i in range(self.request.size)}
        for i in choices:
            first = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield fmt.sse(fmt.chunk("chat.completion.chunk", self.id, self.created, self.body.model, [first]))
        try:
            async for event in _events(self.request):
                entries = self._apply(choices[event.index], event)
                if not event.text and event.finish_reason is None and not entries:
                    continue
                delta = {"content": event.text} if event.text else {}
                choice = {
                    "index": event.index,
                    "delta": delta,
                    "logprobs": {"content": entries} if self.body.logprobs else None,
                    "finish_reason": event.finish_reason,
                }
                yield fmt.sse(
                    fmt.chunk("chat.completion.chunk", self.id, self.created, self.body.model, [choice])
                )
        except APIError as exc:
            yield fmt.sse(error_body(str(exc), exc.type, exc.code))
            return
        self.timing.done(len(self.prompt))
        if self.body.include_usage_in_stream:
            yield fmt.sse(
                fmt.chunk(
                    "chat.completion.chunk", self.id, self.created, self.body.model, [], self._usage(choices)
                )
            )
        yield fmt.sse("[DONE]")
