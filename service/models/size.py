"""Checkpoint size on disk and the bytes of its stored tensors (from safetensors headers, no loading)."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def checkpoint_bytes(path: Path) -> int:
    """Every file under the checkpoint directory (weights, configs, tokenizer)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def weights_bytes(path: Path) -> int:
    """Bytes of the tensors stored in the checkpoint's ``*.safetensors`` files (packed quantized weights,
    scales and zero points count as stored; tied weights stored once count once)."""
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(header_len))
        total += sum(
            end - begin
            for key, v in header.items()
            if key != "__metadata__"
            for begin, end in [v["data_offsets"]]
        )
    return total
