"""A small OpenAI-compatible upstream for gateway tests: it can be slow, fail, or stream, on request.

Each request may carry a ``fake`` object in its body (it also proves the gateway forwards fields it does not
know):

- ``delay``: seconds to wait before answering (before the headers, so the gateway sees nothing meanwhile);
- ``status``: answer with this HTTP status and an OpenAI error body (``raw_error`` true: a plain-text body);
- ``chunks``: content chunks to stream (default 3), ``chunk_delay`` seconds between them;
- ``hang_after``: stream this many chunks, then wait forever (until the client goes away).

``app.state.status`` set: every completion answers that status, whatever the body says (e.g. 503, as a
draining server does); ``app.state.healthy`` false: ``/health`` answers 503.

Every answer names the upstream in ``system_fingerprint``; ``app.state.received`` keeps each request's
headers, body (parsed, and its raw bytes) and the client's port (one per connection);
``app.state.cancelled_streams`` counts streams ended by the client going away.

Run as a script for a separate process that a test can kill: ``python fake_upstream.py --port P --model M``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse


def create_fake(name: str, models: list[str]) -> FastAPI:
    app = FastAPI()
    app.state.received = []
    app.state.cancelled_streams = 0
    app.state.healthy = True
    app.state.status = None

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if app.state.healthy else 503)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        cards = [{"id": m, "object": "model", "created": 0, "owned_by": name} for m in models]
        return {"object": "list", "data": cards}

    async def answer(request: Request, kind: str) -> Response:
        raw = await request.body()
        body = json.loads(raw)
        peer_port = request.client.port if request.client else None
        app.state.received.append(
            {"headers": dict(request.headers), "body": body, "raw": raw, "kind": kind, "peer_port": peer_port}
        )
        fake = body.get("fake") or {}
        if app.state.status is not None:
            fake = {**fake, "status": app.state.status}
        await asyncio.sleep(fake.get("delay", 0))
        if "status" in fake:
            if fake.get("raw_error"):
                return PlainTextResponse("upstream exploded", status_code=fake["status"])
            error = {
                "message": f"fake error {fake['status']}",
                "type": "fake_error",
                "param": None,
                "code": None,
            }
            return JSONResponse({"error": error}, status_code=fake["status"])
        n_chunks = fake.get("chunks", 3)
        words = [f"w{i} " for i in range(n_chunks)]
        prompt = body.get("prompt") if kind == "text_completion" else json.dumps(body.get("messages"))
        usage = {
            "prompt_tokens": len(str(prompt).split()),
            "completion_tokens": n_chunks,
            "total_tokens": len(str(prompt).split()) + n_chunks,
        }
        common = {"id": f"cmpl-{time.time_ns()}", "created": int(time.time()), "model": body["model"]}
        common["system_fingerprint"] = name
        if not body.get("stream"):
            text = "".join(words)
            if kind == "text_completion":
                choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
            else:
                choice = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
            return JSONResponse({**common, "object": kind, "choices": [choice], "usage": usage})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            stream(common, kind, words, fake, include_usage, usage), media_type="text/event-stream"
        )

    async def stream(
        common: dict[str, Any],
        kind: str,
        words: list[str],
        fake: dict[str, Any],
        include_usage: bool,
        usage: dict[str, int],
    ) -> AsyncIterator[bytes]:
        obj = "text_completion" if kind == "text_completion" else "chat.completion.chunk"

        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return f"data: {json.dumps({**common, 'object': obj, 'choices': choices, **extra})}\n\n".encode()

        try:
            if kind != "text_completion":
                yield event(
                    [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
                )
            for i, word in enumerate(words):
                if i == fake.get("hang_after"):
                    await asyncio.Event().wait()
                await asyncio.sleep(fake.get("chunk_delay", 0))
                if kind == "text_completion":
                    yield event([{"index": 0, "text": word, "finish_reason": None, "logprobs": None}])
                else:
                    yield event([{"index": 0, "delta": {"content": word}, "finish_reason": None}])
            if kind == "text_completion":
                yield event([{"index": 0, "text": "", "finish_reason": "length", "logprobs": None}])
            else:
                yield event([{"index": 0, "delta": {}, "finish_reason": "length"}])
            if include_usage:
                yield event([], usage=usage)
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            app.state.cancelled_streams += 1
            raise

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await answer(request, "chat.completion")

    return app


if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--name", default="fake")
    args = parser.parse_args()
    uvicorn.run(create_fake(args.name, args.model), host="127.0.0.1", port=args.port, log_level="warning")
