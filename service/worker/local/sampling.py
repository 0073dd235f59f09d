"""Per-sequence sampling and logprobs over one row of logits.

Logprobs are those of the model's raw distribution (log-softmax of the logits before penalties,
temperature and top-p), as vLLM reports them by default; they are what perplexity and KL need.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # alternatives per generated token; 0 = the chosen token's logprob only
    prompt_logprobs: int | None = None  # same, for every prompt token after the first (echo)
    ignore_eos: bool = False  # keep generating past end-of-sequence tokens (load tests)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return gen


def apply_penalties(logits: torch.Tensor, counts: Counter, params: SamplingParams) -> torch.Tensor:
    """OpenAI's presence/frequency penalties: subtract per token already generated."""
    if not counts or (params.presence_penalty == 0.0 and params.frequency_penalty == 0.0):
        return logits
    ids = torch.tensor(list(counts.keys()), dtype=torch.long)
    n = torch.tensor(list(counts.values()), dtype=logits.dtype)
    logits = logits.clone()
    logits[ids] -= params.frequency_penalty * n + params.presence_penalty
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick the next token from one float32 row of logits (penalties already applied)."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = cumulative - sorted_probs >= params.top_p
        sorted_probs[drop] = 0.0
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())


def token_logprob(logprobs: torch.Tensor, token_id: int, top_k: int) -> TokenLogprob:
    """The chosen token's logprob and the ``top_k`` most likely alternatives from one log-softmax row."""
    entry = TokenLogprob(token_id, float(logprobs[token_id].item()))
    if top_k > 0:
        values, indices = torch.topk(logprobs, top_k)
        entry.top = list(zip(indices.tolist(), values.tolist(), strict=True))
    return entry


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], top_k: int) -> list[TokenLogprob | None]:
    """Logprob of every prompt token given those before it; the first token has none.

    ``logits`` is the prefill output [len(prompt), vocab]: row i predicts token i + 1.
    """
    out: list[TokenLogprob | None] = [None]
    if len(prompt_ids) < 2:
        return out
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    targets = torch.tensor(prompt_ids[1:], dtype=torch.long)
    chosen = lp.gather(1, targets[:, None]).squeeze(1).tolist()
    if top_k > 0:
        values, indices = torch.topk(lp, top_k, dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
    else:
        tops = [[] for _ in chosen]
    out.extend(TokenLogprob(t, c, top) for t, c, top in zip(prompt_ids[1:], chosen, tops, strict=True))
    return out
