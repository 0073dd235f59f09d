"""Perplexity and top-1 agreement with a baseline, over non-overlapping windows of a text file.

    perplexity = exp(mean over predicted tokens of -log p(token | previous tokens in its window))
    agreement  = fraction of predicted positions where argmax logits equal the baseline's argmax

Both models see the same windows; every token after the first of each window is predicted once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F  # noqa: N812
from tqdm.auto import tqdm


@dataclass(frozen=True)
class Evaluation:
    perplexity: float
    tokens: int
    agreement: float | None  # top-1 agreement with the baseline (None without one)


def text_windows(
    path: str | Path, tokenizer: Any, seq_len: int = 512, max_windows: int | None = None
) -> torch.Tensor:
    """``[windows, seq_len]`` token ids of ``path``, cut into non-overlapping windows (tail dropped)."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    if max_windows is not None:
        text = text[: max_windows * seq_len * 8]
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    windows = ids.numel() // seq_len
    if max_windows is not None:
        windows = min(windows, max_windows)
    if windows == 0:
        raise ValueError(f"{path} has fewer than {seq_len} tokens")
    return ids[: windows * seq_len].view(windows, seq_len)


@torch.no_grad()
def evaluate(
    model: Any, windows: torch.Tensor, baseline: Any | None = None, batch_size: int = 4
) -> Evaluation:
    """Perplexity of ``model`` on ``windows`` and, given ``baseline``, their top-1 agreement."""
    nll = 0.0
    count = 0
    agree = 0
    for start in tqdm(range(0, windows.shape[0], batch_size), desc="evaluating", unit="batch", leave=False):
        batch = windows[start : start + batch_size]
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        targets = batch[:, 1:]
        nll += float(
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        )
        count += targets.numel()
        if baseline is not None:
            reference = baseline(input_ids=batch, use_cache=False).logits[:, :-1]
            agree += int((logits.argmax(-1) == reference.argmax(-1)).sum())
    return Evaluation(
        perplexity=math.exp(nll / count),
        tokens=count,
        agreement=agree / count if baseline is not None else None,
    )
