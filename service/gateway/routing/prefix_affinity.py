"""Prefix affinity: requests that share a prompt prefix (or a session) go to the same upstream, with bounded
load.

Why: an engine with prefix caching (vLLM's automatic prefix caching) reuses the KV cache of a prompt prefix
it has already computed, but only on the engine that computed it. Spreading requests that share a long
system prompt over several workers makes every worker compute it again; sending them to one worker makes
the prefix a cache hit after the first request.

How: consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with
Bounded Loads", 2018). Each upstream owns ``VNODES`` points on a hash ring; a request's key hashes to a
point and walks clockwise to the first upstream whose in-flight count is under the cap

    cap = ceil((1 + load_factor) * (in_flight over all candidates + 1) / len(candidates)),

so no upstream takes more than ``1 + load_factor`` times the mean load: a hot prefix spills onto the next
upstream on the ring instead of overloading one. Adding or removing an upstream moves only the keys that
hashed next to its points.

The key: the ``X-Session-Id`` header when the client sends one (a conversation stays on one upstream),
otherwise the first ``prefix_chars`` characters of the prompt (chat: each message's role and text in
order). A short key keeps users who share a system prompt together even where their own text differs.
A request with no text to hash (e.g. token-id prompts) falls back to the least-loaded upstream.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from typing import Any

from squeezeserve.service.gateway.routing.base import RouteRequest
from squeezeserve.service.gateway.routing.least_outstanding import LeastOutstanding
from squeezeserve.service.gateway.upstreams import Upstream

VNODES = 64  # points per upstream: with 2-8 upstreams, each owns a share within a few % of 1/n


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest())


def prompt_prefix(body: dict[str, Any], chars: int) -> str:
    """The first ``chars`` characters of the request's prompt text: ``prompt`` (a string, or the first of a
    list of strings) or the chat ``messages`` as ``role: text`` lines. Empty when there is no text."""
    parts: list[str] = []
    size = 0
    if "messages" in body:
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):  # content parts: the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                continue
            parts.append(f"{message.get('role', '')}: {content}\n")
            size += len(parts[-1])
            if size >= chars:
                break
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            parts.append(prompt)
    return "".join(parts)[:chars]


class PrefixAffinity:
    """Consistent hashing with bounded loads over the request's session id or prompt prefix."""

    def __init__(self, prefix_chars: int = 256, load_factor: float = 0.25) -> None:
        if prefix_chars < 1:
            raise ValueError(f"prefix_chars must be at least 1, got {prefix_chars}")
        if load_factor <= 0:
            raise ValueError(f"load_factor must be positive, got {load_factor}")
        self.prefix_chars = prefix_chars
        self.load_factor = load_factor
        self._rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}
        self._least_loaded = LeastOutstanding()  # for requests with no key

    def key(self, request: RouteRequest) -> str:
        if request.session_id:
            return f"session:{request.session_id}"
        prefix = prompt_prefix(request.body, self.prefix_chars)
        return f"prefix:{prefix}" if prefix else ""

    def _ring(self, urls: tuple[str, ...]) -> tuple[list[int], list[str]]:
        """Sorted ring points and their owners, built once per set of candidates."""
        ring = self._rings.get(urls)
        if ring is None:
            points = sorted((_hash(f"{url}#{i}"), url) for url in urls for i in range(VNODES))
            ring = ([p for p, _ in points], [url for _, url in points])
            if len(self._rings) > 64:  # candidate sets change with health; keep the cache small
                self._rings.clear()
            self._rings[urls] = ring
        return ring

    async def select(self, candidates: Sequence[Upstream], request: RouteRequest) -> Upstream:
        if len(candidates) == 1:
            return candidates[0]
        key = self.key(request)
        if not key:
            return await self._least_loaded.select(candidates, request)
        by_url = {u.url: u for u in candidates}
        points, owners = self._ring(tuple(sorted(by_url)))
        total = sum(u.in_flight for u in candidates) + 1
        cap = math.ceil((1 + self.load_factor) * total / len(candidates))
        start = bisect.bisect(points, _hash(key))
        seen: set[str] = set()
        for step in range(len(points)):
            url = owners[(start + step) % len(points)]
            if url in seen:
                continue
            upstream = by_url[url]
            if upstream.in_flight < cap:
                return upstream
            seen.add(url)
        # Unreachable in practice: the cap is above the mean load, so some candidate is under it.
        return min(candidates, key=lambda u: u.in_flight)
