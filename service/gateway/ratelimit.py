"""Per-key limits: requests per minute and tokens per minute, answered the way OpenAI answers them.

Each limited key has a token bucket per dimension: it holds at most the per-minute limit and refills at
limit / 60 per second, so a key may burst up to its whole minute and then runs at its rate. A completion
request is admitted while the request bucket holds at least one request and the token bucket is above
zero; otherwise it gets 429 with ``Retry-After`` (whole seconds until it would be admitted).

Tokens are charged **after** the answer, from the upstream's own ``usage`` (prompt + completion tokens;
the gateway asks every stream for its usage chunk already, for its metrics), and the bucket may go below
zero: the key then waits until it has paid the debt back. The other choice, reserving prompt +
``max_tokens`` up front, needs the prompt's token count, which the gateway cannot know without the
model's tokenizer (it carries no torch or tokenizers, by design), and ``max_tokens`` is often left out,
meaning "up to the context length": up-front reservation would charge thousands of tokens for a
ten-token reply and turn away keys that are well within their budget. Counting after is exact; its cost is
that one key's requests already in flight when its bucket runs dry all complete (the overshoot is at most
what those requests use), and that answers without a ``usage`` (a stream the client left before its end)
are not charged.

Every response to a limited key carries OpenAI's headers: ``x-ratelimit-limit-requests``,
``x-ratelimit-remaining-requests``, ``x-ratelimit-reset-requests`` (time until the bucket is full again,
written like OpenAI's ``1s``, ``6m0s``, ``120ms``) and the same three for ``-tokens``, as of the moment the
response starts (a stream's own tokens are charged at its end, after its headers left).

The buckets live in the gateway process's memory: with ``--workers N`` each process has its own, and since
the kernel spreads connections over the processes a key gets up to N times its limits. Run one gateway
process per replica (the default) where limits must be exact; the gateway warns at startup otherwise.
Keys without limits cost nothing here: no bucket exists for them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from squeezeserve.service.gateway import errors
from squeezeserve.service.gateway.config import GatewaySettings

Clock = Callable[[], float]


class Bucket:
    """Up to ``per_minute`` units, refilled continuously at ``per_minute / 60`` per second; may go below
    zero when more is used than was left (``charge``)."""

    __slots__ = ("limit", "rate", "level", "updated")

    def __init__(self, per_minute: int, now: float) -> None:
        self.limit = per_minute
        self.rate = per_minute / 60.0
        self.level = float(per_minute)
        self.updated = now

    def refill(self, now: float) -> None:
        self.level = min(self.limit, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def seconds_until(self, level: float) -> float:
        """Seconds until the bucket holds ``level`` (0 if it does now)."""
        return max(0.0, (level - self.level) / self.rate)

    def headers(self, kind: str) -> list[tuple[str, str]]:
        return [
            (f"x-ratelimit-limit-{kind}", str(self.limit)),
            (f"x-ratelimit-remaining-{kind}", str(max(0, math.floor(self.level)))),
            (f"x-ratelimit-reset-{kind}", format_duration(self.seconds_until(self.limit))),
        ]


def format_duration(seconds: float) -> str:
    """A duration the way OpenAI writes it in ``x-ratelimit-reset-*``: ``120ms``, ``8.64s``, ``6m0s``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.2f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{text}s" if minutes else f"{text}s"


class KeyLimits:
    """The buckets of one API key (a dimension without a limit has none)."""

    def __init__(
        self, requests_per_minute: int | None, tokens_per_minute: int | None, clock: Clock = time.monotonic
    ) -> None:
        now = clock()
        self._clock = clock
        self.requests = Bucket(requests_per_minute, now) if requests_per_minute else None
        self.tokens = Bucket(tokens_per_minute, now) if tokens_per_minute else None

    def admit(self) -> None:
        """Count one request, or raise the 429 that says which limit was hit and when to come back."""
        now = self._clock()
        requests, tokens = self.requests, self.tokens
        if requests is not None:
            requests.refill(now)
            if requests.level < 1:
                raise errors.rate_limited("requests", requests.limit, _retry_after(requests, 1))
        if tokens is not None:
            tokens.refill(now)
            if tokens.level <= 0:
                raise errors.rate_limited("tokens", tokens.limit, _retry_after(tokens, 1))
        if requests is not None:
            requests.level -= 1

    def charge(self, usage: Any) -> None:
        """Take an answer's tokens (an OpenAI ``usage`` object: prompt + completion) from the token bucket."""
        if self.tokens is None or not isinstance(usage, dict):
            return
        used = usage.get("total_tokens")
        if not isinstance(used, int):
            used = sum(
                n for n in (usage.get("prompt_tokens"), usage.get("completion_tokens")) if isinstance(n, int)
            )
        self.tokens.refill(self._clock())
        self.tokens.level -= max(0, used)

    def headers(self) -> list[tuple[str, str]]:
        """OpenAI's ``x-ratelimit-*`` headers for the buckets as they are now."""
        now = self._clock()
        pairs = []
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                bucket.refill(now)
                pairs += bucket.headers(kind)
        return pairs


def _retry_after(bucket: Bucket, level: float) -> int:
    return max(1, math.ceil(bucket.seconds_until(level)))


def build_key_limits(settings: GatewaySettings, clock: Clock = time.monotonic) -> dict[str, KeyLimits]:
    """The limits of every key that has some (its own, else the settings' defaults), by key."""
    table = {}
    for entry in settings.api_keys:
        requests = entry.requests_per_minute or settings.requests_per_minute
        tokens = entry.tokens_per_minute or settings.tokens_per_minute
        if requests or tokens:
            table[entry.key] = KeyLimits(requests, tokens, clock)
    return table
