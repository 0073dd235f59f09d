"""Markdown tables of ``results/kernels.csv`` for tests/benchmarks/README.md (p50 values).

python tests/benchmarks/tables.py > /tmp/tables.md
python tests/benchmarks/tables.py /tmp/bench-out/kernels.csv    # a fresh run's CSV (run_gpu.sh prints it)
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

CSV = Path(__file__).parent / "results" / "kernels.csv"
# vLLM's column is its own CUDA op: silu_and_mul (packed input; beside it our silu_and_mul is the
# "squeezeserve.silu_and_mul" provider of the swiglu rows), rms_norm, fused_add_rms_norm.
PROVIDERS = ("torch", "torch.compile", "liger", "vllm")


def main(path: Path = CSV) -> None:
    rows = list(csv.DictReader(path.open()))
    p50: dict[tuple, str] = {}
    pct: dict[tuple, str] = {}
    order: dict[tuple, None] = {}
    for r in rows:
        key = (r["op"], r["mode"], r["shape"])
        p50[(*key, r["provider"], r["metric"])] = r["p50"]
        if r["pct_of_peak"]:
            pct[(*key, r["provider"])] = r["pct_of_peak"]
        if r["op"] != "quant_matmul" and r["provider"] == "squeezeserve":
            order[key] = None
    print("| op | mode | shape | ours ms | ours % | torch ms | torch.compile ms | liger ms | vLLM ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for op, mode, shape in order:
        cells = [p50.get((op, mode, shape, p, "time"), "-") for p in PROVIDERS]
        ours = p50.get((op, mode, shape, "squeezeserve", "time"), "-")
        print(f"| {op} | {mode} | {shape} | {ours} | {pct.get((op, mode, shape, 'squeezeserve'), '-')} | "
              + " | ".join(cells) + " |")  # fmt: skip
    print()
    print("| M x N x K | kernel | ours ms | bf16 ms | ours speedup | Marlin speedup | Machete speedup |")
    print("|---|---|---|---|---|---|---|")
    quant = defaultdict(dict)
    for r in rows:
        if r["op"] == "quant_matmul":
            quant[r["shape"]][(r["provider"], r["metric"])] = r["p50"]
    for shape, cells in sorted(quant.items(), key=lambda item: _mnk(item[0])):
        for provider in sorted({p for p, _ in cells if p.startswith("squeezeserve")}):
            tag = provider.removeprefix("squeezeserve-")
            keys = [(provider, "time"), ("torch-bf16", "time"), (provider, "speedup_vs_bf16")]
            keys += [(f"vllm-{peer}-{tag}", "speedup_vs_bf16") for peer in ("marlin", "machete")]
            values = [cells.get(key, "-") for key in keys]
            print(f"| {shape} | {tag} | " + " | ".join(values) + " |")


def _mnk(shape: str) -> tuple[int, ...]:
    """Sort key of an M x N x K shape: by N, K, then M."""
    m, n, k = map(int, shape.split("x"))
    return n, k, m


if __name__ == "__main__":
    import sys

    main(Path(sys.argv[1]) if len(sys.argv) > 1 else CSV)
