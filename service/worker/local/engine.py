"""The embedded engine: continuous batching over a causal LM on one thread.

One background thread owns the model. Requests wait in a FIFO queue; each loop iteration admits waiting
requests while the batch has room (prefilling each prompt once, then copying its KV cache for ``n``
choices), runs ONE decode step for every active sequence together, and hands each sequence's new token to
its request's asyncio queue. Every active sequence advances one token per step, so concurrent requests
share the machine fairly, and a decode step costs about the same for 1 or 16 rows on a memory-bound CPU.

The model and the batch's KV cache live in a decoder (``decoder.py``): our static Llama decoder on CPU,
or the Hugging Face model with a left-padded cache for everything else. Finished or cancelled rows are
dropped from the batch after each step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from squeezeserve.service.worker.local.decoder import StaticDecoder, TransformersDecoder
from squeezeserve.service.worker.local.detokenize import IncrementalDetokenizer
from squeezeserve.service.worker.local.sampling import (
    SamplingParams,
    TokenLogprob,
    apply_penalties,
    make_generator,
    prompt_logprobs,
    sample,
    token_logprob,
)

log = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the caller should retry later."""


@dataclass
class Event:
    """What one engine step produced for one sequence."""

    index: int  # choice index within the request: prompt_index * n + i
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    first: bool = False  # the prefill's event: the sequence's first token (and prompt logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first event only, when asked for
    error: str | None = None


class Request:
    """One API call: ``len(prompts) * n`` sequences sharing sampling parameters and one event queue."""

    def __init__(self, prompts: list[list[int]], n: int, params: SamplingParams) -> None:
        self.prompts = prompts
        self.n = n
        self.params = params
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[list[Event]] = asyncio.Queue()
        self.cancelled = False
        self.arrival = time.perf_counter()

    @property
    def size(self) -> int:
        return len(self.prompts) * self.n

    def cancel(self) -> None:
        """Called from the event loop (client gone); the engine drops the sequences at its next step."""
        self.cancelled = True

    def _push(self, events: list[Event]) -> None:
        if events:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, events)


@dataclass
class _Sequence:
    request: Request
    index: int
    prompt_len: int
    detok: IncrementalDetokenizer
    generator: torch.Generator
    length: int  # tokens in the KV cache for this row (its next position)
    last_token: int = -1
    generated: int = 0
    counts: Counter = field(default_factory=Counter)
    finish_reason: str | None = None


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    batch_rows: int = 0  # sum of batch sizes over steps (mean batch = batch_rows / steps)
    preemptions: int = 0


class Engine:
    def __init__(
        self,
        decoder: TransformersDecoder | StaticDecoder,
        tokenizer: Any,
        eos_token_ids: set[int],
        max_batch_size: int,
        max_waiting: int,
        threads: int | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, not {max_batch_size}")
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.threads = threads  # torch intra-op threads of the engine thread; None leaves torch's setting
        self.stats = EngineStats()
        self._waiting: deque[Request] = deque()
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._warm = threading.Event()
        self._seqs: list[_Sequence] = []
        self._thread = threading.Thread(target=self._run, name="squeezeserve-engine", daemon=True)

    # -- called from the event loop ------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread and return once its decoder is warm (compiled), so that the server
        listens only when the first request will not wait for a compile."""
        self._thread.start()
        self._warm.wait()

    @property
    def alive(self) -> bool:
        """The engine thread is running (``/health`` fails when it is not)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._wakeup.set()
        self._thread.join(timeout=30)

    def submit(self, request: Request) -> None:
        with self._lock:
            if len(self._waiting) >= self.max_waiting:
                raise EngineOverloaded(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append(request)
            self.stats.waiting = len(self._waiting)
        self._wakeup.set()

    # -- engine thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        if self.threads is not None:  # OpenMP's thread count is per calling thread: set it on this one
            torch.set_num_threads(self.threads)
        try:  # here, after set_num_threads: inductor writes CPU kernels for the compiling thread's count
            seconds = self.decoder.warm_up()
            if seconds:
                log.info("decoder compiled in %.1f s", seconds)
        finally:
            self._warm.set()
        with torch.inference_mode():
            while not self._stop.is_set():
                try:
                    self._admit()
                    if not self._seqs:
                        self._wakeup.wait(timeout=1.0)
                        self._wakeup.clear()
                        continue
                    self._step()
                except Exception as exc:  # keep serving: fail the sequences in flight, not the process
                    log.exception("engine step failed")
                    self._fail_all(f"engine error: {exc}")

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._waiting:
                    return
                request = self._waiting[0]
                room = self.max_batch_size - len(self._seqs)
                # FIFO: the head waits for rows to free up, and nobody overtakes it. A request larger than
                # the whole batch is admitted alone.
                if not request.cancelled and self._seqs and request.size > room:
                    return
                self._waiting.popleft()
                self.stats.waiting = len(self._waiting)
            if not request.cancelled:
                self._prefill(request)

    def _prefill(self, request: Request) -> None:
        params = request.params
        for p, prompt in enumerate(request.prompts):
            want_prompt_lp = params.prompt_logprobs is not None
            logits = self.decoder.prefill(prompt, want_prompt_lp)
            self.stats.prompt_tokens += len(prompt)
            plp = prompt_logprobs(logits, prompt, params.prompt_logprobs) if want_prompt_lp else None
            last = logits[-1].float()
            new: list[_Sequence] = []
            for i in range(request.n):
                seq = _Sequence(
                    request=request,
                    index=p * request.n + i,
                    prompt_len=len(prompt),
                    detok=IncrementalDetokenizer(self.tokenizer, prompt, list(params.stop)),
                    generator=make_generator(None if params.seed is None else params.seed + i),
                    length=len(prompt),
                )
                event = Event(index=seq.index, first=True, prompt_logprobs=plp)
                if params.max_tokens == 0:
                    seq.finish_reason = event.finish_reason = "length"
                else:
                    self._accept(seq, last, event)
                request._push([event])
                if seq.finish_reason is None:
                    new.append(seq)
            if new:
                self.decoder.join(len(new))
                self._seqs = self._seqs + new
                self.stats.running = len(self._seqs)

    def _accept(self, seq: _Sequence, logits: torch.Tensor, event: Event) -> None:
        """Sample the next token for ``seq`` from its float32 logits row and record it in ``event``."""
        params = seq.request.params
        token = sample(apply_penalties(logits, seq.counts, params), params, seq.generator)
        if params.logprobs is not None:
            event.logprobs.append(token_logprob(torch.log_softmax(logits, -1), token, params.logprobs))
        seq.last_token = token
        seq.generated += 1
        seq.counts[token] += 1
        event.token_ids.append(token)
        self.stats.generation_tokens += 1
        if token in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        else:
            event.text += seq.detok.add(token)
            if seq.detok.stopped:
                seq.finish_reason = "stop"
        if seq.finish_reason is None and seq.generated >= params.max_tokens:
            seq.finish_reason = "length"
        if seq.finish_reason is not None and not seq.detok.stopped:
            event.text += seq.detok.flush()
        event.finish_reason = seq.finish_reason

    def _step(self) -> None:
        seqs = self._seqs
        logits = self.decoder.step([s.last_token for s in seqs], [s.length for s in seqs]).float()
        self.stats.steps += 1
        self.stats.batch_rows += len(seqs)
        per_request: dict[int, tuple[Request, list[Event]]] = {}
        for row, seq in enumerate(seqs):
            seq.length += 1
            request = seq.request
            if request.cancelled:
                seq.finish_reason = "abort"
                continue
            event = Event(index=seq.index)
            self._accept(seq, logits[row], event)
            per_request.setdefault(id(request), (request, []))[1].append(event)
        for request, events in per_request.values():
            request._push(events)
        self._retire()

    def _retire(self) -> None:
        keep = [i for i, s in enumerate(self._seqs) if s.finish_reason is None]
        if len(keep) != len(self._seqs):
            self._seqs = [self._seqs[i] for i in keep]
            self.decoder.retire(keep, [s.length for s in self._seqs])
        self.stats.running = len(self._seqs)

    def _fail_all(self, message: str) -> None:
        failed = {id(s.request): s.request for s in self._seqs}
        for s in self._seqs:
            s.request._push([Event(index=s.index, finish_reason="error", error=message)])
        self._seqs = []
        self.decoder.reset()
        self.stats.running = 0
        log.error("failed %d requests: %s", len(failed), message)
