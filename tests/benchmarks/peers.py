"""The GPU benchmarks' peers (vLLM's Marlin and Machete kernels): what they share. No torch, Triton or
squeezeserve import here: the CPU suite loads this file before tests/kernels/conftest.py sets
TRITON_INTERPRET."""

from __future__ import annotations

import sys


def peer_weight(cache: dict, key, pack, label: str):
    """A peer's re-quantized weight for ``key``: ``cache[key]``, made by ``pack()`` on first use (one weight a
    shape, whatever the row count; the cache holds the latest shape only), or None where the peer refuses the
    shape (``pack`` raised: Machete's prepack needs K in multiples of 128): said once on stderr, and the peer
    then skips that shape's rows instead of ending the run."""
    if key not in cache:
        cache.clear()
        try:
            cache[key] = pack()
        except Exception as exc:
            print(f"# {label} {key}: skipped, {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
            cache[key] = None
    return cache[key]
