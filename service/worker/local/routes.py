"""The embedded worker's endpoints: ``/health``, ``/metrics``, ``/v1/models[/{id}]``, ``/v1/completions``
and ``/v1/chat/completions``. Each tokenizes, checks limits, submits one engine request and answers
through ``responses.respond``."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from squeezeserve.service.errors import invalid_request, model_not_found
from squeezeserve.service.protocol import ChatCompletionRequest, CompletionRequest, error_body
from squeezeserve.service.worker.local.responses import ChatResponse, CompletionResponse, respond
from squeezeserve.service.worker.local.service import WorkerService, parse_body, sampling_params


def _service(request: Request) -> WorkerService:
    return request.app.state.service


ServiceDep = Annotated[WorkerService, Depends(_service)]

router = APIRouter()


@router.get("/health")
async def health(service: ServiceDep) -> Response:
    if not service.engine.alive:
        return JSONResponse(error_body("engine thread is not running", "server_error"), status_code=503)
    return JSONResponse({"status": "ok", "model": service.served_name})


@router.get("/metrics")
async def metrics(service: ServiceDep) -> Response:
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(service: ServiceDep) -> dict[str, Any]:
    return {"object": "list", "data": [service.model_card()]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, service: ServiceDep) -> dict[str, Any]:
    if model_id != service.served_name:
        raise model_not_found(model_id)
    return service.model_card()


@router.post("/v1/completions")
async def completions(http: Request, service: ServiceDep) -> Response:
    start = time.perf_counter()
    body: CompletionRequest = await parse_body(http, CompletionRequest)
    service.check_model(body.model)
    prompts = [service.encode(p) for p in body.prompts()]
    max_tokens = service.output_budget([len(p) for p in prompts], body.max_tokens, "max_tokens")
    prompt_logprobs = body.logprobs if body.echo else None
    params = sampling_params(body, max_tokens, body.logprobs, prompt_logprobs)
    request = service.submit(prompts, body.n, params)
    return await respond(http, CompletionResponse(service, body, prompts, request, start), body.stream)


@router.post("/v1/chat/completions")
async def chat(http: Request, service: ServiceDep) -> Response:
    start = time.perf_counter()
    body: ChatCompletionRequest = await parse_body(http, ChatCompletionRequest)
    service.check_model(body.model)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = service.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # templates raise on roles or orders they do not support
        raise invalid_request(f"The chat template rejected the messages: {exc}", "messages") from exc
    prompt = service.encode(text, add_special_tokens=False)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = service.output_budget([len(prompt)], body.output_limit, param)
    top = (body.top_logprobs or 0) if body.logprobs else None
    request = service.submit([prompt], body.n, sampling_params(body, max_tokens, top, None))
    return await respond(http, ChatResponse(service, body, len(prompt), request, start), body.stream)
