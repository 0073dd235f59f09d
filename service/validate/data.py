"""Evaluation data: the text to score, its sliding windows, and multiple-choice task items."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from squeezeserve.service.datasets import resolve
from squeezeserve.service.validate.specs import UsageError

HF_PREFIX = "hf:"


def read_text(dataset: str) -> str:
    """The text of ``dataset``: a UTF-8 file, ``sample:NAME`` (a text shipped with the package), or
    ``hf:NAME[:CONFIG[:SPLIT]]`` (the ``datasets`` package, online; its ``text`` column joined by
    newlines; split defaults to ``test``)."""
    if dataset.startswith(HF_PREFIX):
        return _read_hf(dataset[len(HF_PREFIX) :])
    try:
        path = Path(resolve(dataset))
    except KeyError as exc:
        raise UsageError(f"--dataset: {exc.args[0]}") from None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--dataset {dataset}: cannot read it as UTF-8 text ({exc})") from exc
    if not text.strip():
        raise UsageError(f"--dataset {dataset} is empty")
    return text


def _read_hf(name: str) -> str:
    try:
        import datasets
    except ImportError as exc:
        raise UsageError("--dataset hf:...: the 'datasets' package is not installed") from exc
    parts = name.split(":")
    split = parts[2] if len(parts) > 2 else "test"
    try:
        rows = datasets.load_dataset(parts[0], parts[1] if len(parts) > 1 else None, split=split)
    except Exception as exc:  # datasets raises many kinds (offline, unknown name, bad config)
        raise UsageError(f"--dataset hf:{name}: cannot load it ({exc})") from exc
    if "text" not in rows.column_names:
        raise UsageError(f"--dataset hf:{name} has no 'text' column (columns: {rows.column_names})")
    return "\n".join(rows["text"])


def tokenize(tokenizer: Any, text: str, max_tokens: int | None) -> list[int]:
    """Token ids of ``text`` (no special tokens), cut to ``max_tokens``.

    Only a prefix of the text is tokenized when a cut is asked for (8 characters a token is generous for
    BPE vocabularies; the prefix grows if it falls short)."""
    chars = len(text) if max_tokens is None else max_tokens * 8
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        if max_tokens is None or len(ids) > max_tokens or chars >= len(text):
            return ids if max_tokens is None else ids[:max_tokens]
        chars *= 2


@dataclass(frozen=True)
class Window:
    """``ids`` go through the model; their last ``scored`` tokens are predicted and counted."""

    begin: int
    ids: list[int]
    scored: int


def sliding_windows(ids: list[int], window: int, stride: int) -> list[Window]:
    """Hugging Face's sliding-window perplexity recipe: windows of ``window`` tokens start every ``stride``
    tokens; each scores only the tokens the previous window did not, so every token but the first is
    predicted exactly once, with at least ``window - stride`` tokens of context carried over."""
    if window < 2:
        raise UsageError(f"--window must be at least 2 tokens, got {window}")
    if not 0 < stride < window:
        # stride == window would leave each window's first token without context inside its window
        raise UsageError(f"--stride must be in 1..{window - 1} (less than --window), got {stride}")
    if len(ids) < 2:
        raise UsageError(f"the dataset slice has {len(ids)} token(s); perplexity needs at least 2")
    windows: list[Window] = []
    scored_until = 1  # token 0 has no prediction
    for begin in range(0, len(ids), stride):
        end = min(begin + window, len(ids))
        windows.append(Window(begin, ids[begin:end], end - scored_until))
        scored_until = end
        if end == len(ids):
            break
    return windows


@dataclass(frozen=True)
class TaskItem:
    context: str
    choices: list[str]
    answer: int


def read_task(path: str) -> list[TaskItem]:
    """A JSONL multiple-choice file: one ``{"context": str, "choices": [str, ...], "answer": int}`` per
    line. Choices are scored as continuations of the context, so they usually start with a space."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--task {path}: cannot read it ({exc})") from exc
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            item = TaskItem(str(row["context"]), [str(c) for c in row["choices"]], int(row["answer"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise UsageError(f"--task {path}:{number}: expected context, choices and answer ({exc})") from exc
        if len(item.choices) < 2 or not 0 <= item.answer < len(item.choices):
            raise UsageError(f"--task {path}:{number}: needs 2+ choices and an answer index among them")
        items.append(item)
    if not items:
        raise UsageError(f"--task {path} has no items")
    return items
