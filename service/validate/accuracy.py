"""Accuracy of a candidate against its baseline: perplexity, fidelity (KL, top-1 agreement), task accuracy.

Perplexity over the sliding windows of ``data.sliding_windows`` (N scored tokens, each counted once):

    PPL = exp( (1/N) * sum_t -log p(x_t | x_<t in its window) )

Fidelity, as llama.cpp's ``perplexity --kl-divergence`` reports it, at every scored position t with P the
baseline's and Q the candidate's next-token distribution:

    ln(PPL_c / PPL_b)        KL_t = sum_v P_t(v) (log P_t(v) - log Q_t(v))  (mean and p99 over t)
    top-1 agreement = mean_t [argmax P_t == argmax Q_t]

Two ways to score a model, behind one ``score(ids, scored)``:

- ``LocalScorer`` runs a checkpoint in this process. The loss goes through our fused linear cross-entropy
  (``squeezeserve.kernels.fused_linear_cross_entropy``), so no [tokens, vocab] logits exist for it. When
  both sides are local, KL and agreement are exact: both models' logits are formed ``chunk`` positions at a
  time, so beyond the two models' activations for one window the peak is about
  ``2 models x 3 buffers x chunk x vocab x 4 bytes`` (fp32 log-probs, their exp and the product): 75 MB
  for chunk 128 and SmolLM2's 49152-token vocabulary, whatever the window.
- ``HttpScorer`` asks an OpenAI-compatible endpoint for ``echo`` + ``logprobs`` on ``/v1/completions``
  with the window's token ids as the prompt (so both sides score the very same tokens). Perplexity is
  exact up to the endpoint's arithmetic. Endpoints give only the top-k log-probs (k <= 20), so KL is not
  computed over HTTP (a top-k truncation would miss an unknown share of the mass: reported as
  unavailable), and top-1 agreement compares each side's top-1 alternative by token text.

Models whose logits are not ``lm_head(final hidden state)`` (logit soft-capping or scaling) are outside
the local path's contract.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import torch
from torch.nn import functional as F  # noqa: N812

from squeezeserve.service.validate.data import TaskItem, Window
from squeezeserve.service.validate.specs import ModelSpec, UsageError
from squeezeserve.service.worker.local.openai_format import TokenText

KL_CHUNK = 128
HTTP_TOP_K = 1  # top-1 agreement needs the best alternative only
Progress = Callable[[int], None]


@dataclass
class ScoredWindow:
    nll_sum: float  # sum of -log p over the scored tokens
    top1: list[str] | None  # text of the most likely token at each scored position, when asked for


class LocalScorer:
    """A causal LM in this process: any transformers model (e.g. ``load_model(path).model``) and its
    tokenizer. ``squeezeserve compress`` scores its output through this too."""

    exact = True

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.head = model.get_output_embeddings()
        weight = getattr(self.head, "weight", None)
        # A quantized head has no plain weight matrix: its logits then go through the module, chunked.
        plain = isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.is_floating_point()
        self.head_weight = weight if plain else None
        self.head_bias = getattr(self.head, "bias", None) if plain else None
        self.token_text = TokenText(tokenizer)  # token text as the worker shows it in logprobs

    @classmethod
    def load(cls, path: Any, dtype: str = "auto", device: str = "cpu") -> LocalScorer:
        """A checkpoint through ``squeezeserve.service.models.loader.load_model`` (compressed ones too)."""
        from squeezeserve.service.models.loader import load_model

        loaded = load_model(path, dtype=dtype, device=device)
        return cls(loaded.model, loaded.tokenizer)

    @torch.no_grad()
    def hidden(self, ids: list[int]) -> torch.Tensor:
        """Final hidden states [len(ids), hidden] (after the last norm): row i predicts token i + 1."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        return self.model.base_model(input_ids=x, use_cache=False).last_hidden_state[0]

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    @torch.no_grad()
    def nll_sum(self, hidden: torch.Tensor, ids: list[int], scored: int) -> float:
        """-sum log p of the last ``scored`` tokens of ``ids`` given the hidden states of ``ids``."""
        n = len(ids)
        rows = hidden[n - scored - 1 : n - 1]
        target = torch.tensor(ids[n - scored :], dtype=torch.long, device=hidden.device)
        if self.head_weight is not None:
            from squeezeserve.kernels import fused_linear_cross_entropy

            loss = fused_linear_cross_entropy(rows, self.head_weight, target, self.head_bias, reduction="sum")
            return float(loss)
        total = 0.0
        for start in range(0, scored, KL_CHUNK):
            chunk = self.logits(rows[start : start + KL_CHUNK]).float()
            total += float(F.cross_entropy(chunk, target[start : start + KL_CHUNK], reduction="sum"))
        return total

    @torch.no_grad()
    def score(self, ids: list[int], scored: int, top1: bool = False) -> ScoredWindow:
        hidden = self.hidden(ids)
        best = None
        if top1:
            rows = hidden[len(ids) - scored - 1 : len(ids) - 1]
            best = []
            for start in range(0, scored, KL_CHUNK):
                best += self.logits(rows[start : start + KL_CHUNK]).argmax(-1).tolist()
            best = [self.token_text(t) for t in best]
        return ScoredWindow(self.nll_sum(hidden, ids, scored), best)


class HttpScorer:
    """An OpenAI-compatible endpoint: ``echo`` + ``logprobs`` on ``/v1/completions``."""

    exact = False

    def __init__(self, spec: ModelSpec, api_key: str | None, timeout: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.spec = spec
        self.client = httpx.Client(base_url=spec.base_url or "", headers=headers, timeout=timeout)

    def close(self) -> None:
        self.client.close()

    def check(self) -> None:
        """Fail fast (a usage error) when the endpoint is unreachable, refuses the key or lacks the model."""
        try:
            response = self.client.get("/models")
        except httpx.HTTPError as exc:
            raise UsageError(f"{self.spec.raw}: endpoint unreachable ({exc})") from exc
        if response.status_code in (401, 403):
            raise UsageError(
                f"{self.spec.raw}: the endpoint refused the API key (HTTP {response.status_code})"
            )
        if response.status_code != 200:
            raise UsageError(f"{self.spec.raw}: GET /models answered HTTP {response.status_code}")
        try:
            served = [m.get("id") for m in response.json().get("data", [])]
        except (ValueError, AttributeError) as exc:
            raise UsageError(f"{self.spec.raw}: GET /models did not answer an OpenAI model list") from exc
        if self.spec.model not in served:
            raise UsageError(f"{self.spec.raw}: the endpoint serves {served}, not {self.spec.model!r}")

    def score(self, ids: list[int], scored: int, top1: bool = False) -> ScoredWindow:
        # max_tokens=1, not 0: endpoints differ on whether 0 is allowed; the generated token's entry sits
        # after the prompt's and is cut off below.
        body = {
            "model": self.spec.model,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "echo": True,
            "logprobs": HTTP_TOP_K,
        }
        response = self.client.post("/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(
                f"{self.spec.raw}: /completions answered HTTP {response.status_code}: {response.text}"
            )
        logprobs = response.json()["choices"][0]["logprobs"]
        token_lp = logprobs["token_logprobs"][: len(ids)]
        if len(token_lp) != len(ids) or any(lp is None for lp in token_lp[len(ids) - scored :]):
            raise RuntimeError(f"{self.spec.raw}: echo returned no prompt logprobs for every token")
        nll = -math.fsum(token_lp[len(ids) - scored :])
        best = None
        if top1:
            tops = logprobs["top_logprobs"][len(ids) - scored : len(ids)]
            best = [max(top, key=top.get) for top in tops]
        return ScoredWindow(nll, best)


Scorer = LocalScorer | HttpScorer


@dataclass
class SideAccuracy:
    perplexity: float
    nll_sum: float
    tokens: int
    task_accuracy: float | None = None


@dataclass
class Fidelity:
    method: str  # "exact" or why it is partial
    ln_ppl_ratio: float
    kl_mean: float | None
    kl_p99: float | None
    top1_agreement: float | None
    kl_per_token: list[float] | None = None  # for the plot; not written to report.json


@torch.no_grad()
def exact_fidelity(
    hidden_b: torch.Tensor, baseline: LocalScorer, hidden_c: torch.Tensor, candidate: LocalScorer, scored: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL(P_b || Q_c) and top-1 agreement over the last ``scored`` predictions of a window,
    ``KL_CHUNK`` positions at a time (peak memory: see the module docstring)."""
    n = hidden_b.shape[0]
    rows_b, rows_c = hidden_b[n - scored - 1 : n - 1], hidden_c[n - scored - 1 : n - 1]
    kls, agrees = [], []
    for start in range(0, scored, KL_CHUNK):
        log_p = baseline.logits(rows_b[start : start + KL_CHUNK]).float().log_softmax(-1)
        log_q = candidate.logits(rows_c[start : start + KL_CHUNK]).float().log_softmax(-1)
        kls.append((log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0))  # rounding can dip below 0
        agrees.append(log_p.argmax(-1) == log_q.argmax(-1))
    return torch.cat(kls), torch.cat(agrees)


def compare(
    baseline: Scorer, candidate: Scorer, windows: list[Window], progress: Progress | None = None
) -> tuple[SideAccuracy, SideAccuracy, Fidelity]:
    """Perplexity of both sides over ``windows`` and the candidate's fidelity to the baseline."""
    exact = isinstance(baseline, LocalScorer) and isinstance(candidate, LocalScorer)
    nll_b = nll_c = 0.0
    tokens = 0
    kls: list[torch.Tensor] = []
    agree = 0
    for window in windows:
        if exact:
            hidden_b, hidden_c = baseline.hidden(window.ids), candidate.hidden(window.ids)
            nll_b += baseline.nll_sum(hidden_b, window.ids, window.scored)
            nll_c += candidate.nll_sum(hidden_c, window.ids, window.scored)
            kl, same = exact_fidelity(hidden_b, baseline, hidden_c, candidate, window.scored)
            kls.append(kl)
            agree += int(same.sum())
        else:
            scored_b = baseline.score(window.ids, window.scored, top1=True)
            scored_c = candidate.score(window.ids, window.scored, top1=True)
            nll_b, nll_c = nll_b + scored_b.nll_sum, nll_c + scored_c.nll_sum
            agree += sum(b == c for b, c in zip(scored_b.top1 or [], scored_c.top1 or [], strict=True))
        tokens += window.scored
        if progress is not None:
            progress(window.scored)
    side_b = SideAccuracy(math.exp(nll_b / tokens), nll_b, tokens)
    side_c = SideAccuracy(math.exp(nll_c / tokens), nll_c, tokens)
    ln_ratio = (nll_c - nll_b) / tokens
    if exact:
        kl = torch.cat(kls).double()
        fidelity = Fidelity(
            "exact",
            ln_ratio,
            float(kl.mean()),
            float(torch.quantile(kl, 0.99)),
            agree / tokens,
            kl.tolist(),
        )
    else:
        fidelity = Fidelity(
            "endpoint logprobs: KL unavailable (top-k only), top-1 agreement by token text",
            ln_ratio,
            None,
            None,
            agree / tokens,
        )
    return side_b, side_c, fidelity


def task_accuracy(
    scorer: Scorer, tokenizer: Any, items: list[TaskItem], progress: Progress | None = None
) -> float:
    """Share of items whose answer has the highest log-likelihood as a continuation of the context."""
    correct = 0
    for item in items:
        context = tokenizer(item.context, add_special_tokens=False)["input_ids"]
        if not context:
            raise UsageError("--task: every item needs a non-empty context")
        nlls = []
        for choice in item.choices:
            ids = tokenizer(choice, add_special_tokens=False)["input_ids"]
            nlls.append(scorer.score(context + ids, len(ids)).nll_sum)
        correct += int(min(range(len(nlls)), key=nlls.__getitem__) == item.answer)
        if progress is not None:
            progress(1)
    return correct / len(items)
