"""What the worker's routes share: the model, the engine, the metrics, and turning a request into engine
work (parsing, tokenizing, limits, submission), raising OpenAI errors the client can act on."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from squeezeserve.service.errors import APIError, invalid_request, model_not_found
from squeezeserve.service.models.loader import LoadedModel
from squeezeserve.service.protocol import validation_message
from squeezeserve.service.serving import CLIENT_CLOSED_REQUEST
from squeezeserve.service.worker.local import openai_format as fmt
from squeezeserve.service.worker.local.decoder import make_decoder
from squeezeserve.service.worker.local.engine import Engine, EngineOverloaded
from squeezeserve.service.worker.local.engine import Request as EngineRequest
from squeezeserve.service.worker.local.metrics import WorkerMetrics
from squeezeserve.service.worker.local.sampling import SamplingParams
from squeezeserve.service.worker.settings import WorkerSettings


class WorkerService:
    """Holds what the routes share: the model, the engine and the metrics."""

    def __init__(self, loaded: LoadedModel, settings: WorkerSettings) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.served_name = settings.served_name
        try:
            decoder = make_decoder(loaded.model, settings.decoder, settings.max_batch_size, settings.compile)
        except ValueError as exc:
            raise ValueError(f"--decoder {settings.decoder} --compile {settings.compile}: {exc}") from exc
        self.decoder_name = decoder.name
        self.engine = Engine(
            decoder,
            loaded.tokenizer,
            loaded.eos_token_ids,
            max_batch_size=settings.max_batch_size,
            max_waiting=settings.max_waiting,
            threads=settings.threads,
        )
        self.metrics = WorkerMetrics(self.engine.stats, self.served_name)
        self.token_text = fmt.TokenText(loaded.tokenizer)
        self.vocab_size = len(loaded.tokenizer)
        self.created = fmt.now()

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.served_name,
            "object": "model",
            "created": self.created,
            "owned_by": "squeezeserve",
            "root": self.loaded.path,
            "max_model_len": self.loaded.max_context,
        }

    def check_model(self, model: str) -> None:
        if model != self.served_name:
            raise model_not_found(model)

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        else:
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise invalid_request(
                    f"Token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1}).", "prompt"
                )
            ids = list(prompt)
        if not ids:
            raise invalid_request("The prompt is empty.", "prompt")
        return ids

    def output_budget(self, prompt_lens: list[int], max_tokens: int | None, param: str) -> int:
        context = self.loaded.max_context
        longest = max(prompt_lens)
        if longest >= context:
            raise invalid_request(
                f"The prompt has {longest} tokens; this model's context is {context} tokens.", "prompt"
            )
        if max_tokens is None:
            return context - longest
        if longest + max_tokens > context:
            raise invalid_request(
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


async def parse_body(http: Request, model: type[BaseModel]) -> Any:
    """The request body validated against ``model``; 400 naming the field when it does not fit."""
    try:
        raw = await http.body()
    except ClientDisconnect as exc:  # gone before its body arrived (a gateway's deadline): nobody reads this
        message = "The client closed the request."
        raise APIError(CLIENT_CLOSED_REQUEST, message, "invalid_request_error", "client_closed") from exc
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise invalid_request(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_request(*validation_message(exc.errors())) from exc


def sampling_params(
    body: Any, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None
) -> SamplingParams:
    """The engine's sampling parameters for a completions or chat request."""
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
