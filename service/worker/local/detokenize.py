"""Incremental detokenization with stop strings.

Decoding only the last few tokens each step (vLLM's prefix/read offsets) keeps the cost per token
constant; stop strings are matched on the decoded text, and text that could still become a stop string is
held back so a stream never shows part of one.
"""

from __future__ import annotations

from typing import Any

# Tokens decoded before the new ones, so byte-level BPE merges and leading spaces come out right.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far (stop string excluded once matched)
        self._emitted = 0  # characters of `text` already handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one token; return the text that is now safe to emit (possibly empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        if self._stop:
            self._check_stop()
        return self._take(final=self.stopped)

    def _check_stop(self) -> None:
        # A stop string can only end inside the newest text, but may start before it.
        window_start = max(0, self._emitted - self._hold)
        best = -1
        for s in self._stop:
            at = self.text.find(s, window_start)
            if at != -1 and (best == -1 or at < best):
                best = at
        if best != -1:
            self.text = self.text[:best]
            self.stopped = True

    def _take(self, final: bool) -> str:
        end = len(self.text) if final or not self._stop else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out

    def flush(self) -> str:
        """Release held-back text when the sequence ends for another reason (length, eos)."""
        return self._take(final=True)
