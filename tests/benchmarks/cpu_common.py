"""Shared by the CPU benchmarks (bench_cpu, bench_engine_vs_generate, bench_worker): the prompt text, what
machine a row was measured on, and appending rows to a fixed-schema CSV."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping
from pathlib import Path

TEXT = (
    "The history of the Roman Empire spans more than a thousand years, from the founding of the city "
    "to the fall of Constantinople. Its roads, laws and language shaped much of Europe, and historians "
    "still argue about why the western half collapsed while the eastern half endured for centuries."
)


def cpu_description(cpuinfo: str | None = None) -> tuple[str, str]:
    """(model name, the vector flags that decide CPU matmul speed: avx2, avx512*, amx*) from /proc/cpuinfo."""
    name, flags = "unknown", set()
    text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    for line in text.splitlines():
        if line.startswith("model name") and name == "unknown":
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    vector = sorted(f for f in flags if f.startswith(("avx2", "avx512", "amx")))
    return name, " ".join(vector)


def llama_cpp_features(system_info: str) -> list[str]:
    """The features a llama.cpp build has on, from ``llama_print_system_info()``.

    That string is ``"CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | ... | "`` (one ``BACKEND :`` prefix per backend
    in newer builds); a feature counts when its value is not 0, in the order given, each once.
    """
    features: list[str] = []
    for item in system_info.split("|"):
        key, sep, value = item.rpartition("=")
        key = key.rpartition(":")[2].strip()
        if sep and key and value.strip() not in ("", "0") and key not in features:
            features.append(key)
    return features


def append_rows(path: Path, fields: list[str], rows: Iterable[Mapping[str, object]]) -> None:
    """Append ``rows`` to the CSV at ``path``, writing the header when the file is new. An existing file
    with another header is refused: rows under the wrong columns would read as valid figures."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size:
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
        if header != fields:
            raise ValueError(f"{path} has the columns {header}, not {fields}: move it aside or migrate it")
    new = not path.exists() or not path.stat().st_size
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new:
            writer.writeheader()
        writer.writerows(rows)
