"""Device probe for issue #16's unmet items: one call of a kernel for Nsight Compute (ncu) to read.

Each case runs its product twice (compiles, warms the allocator) and a third time inside the NVTX range
``prof``, which ncu selects (``--nvtx --nvtx-include prof/``), so the report holds that call's kernels only.
ncu replays each kernel once per metric pass with the caches flushed (cold weights, as the benchmarks time
them). ``run_ncu`` runs every case under ncu and writes one text report per case:

    python3 tests/gpu/ncu_probe.py --list
    python3 tests/gpu/ncu_probe.py CASE              # the case alone (what ncu launches)
    python3 tests/gpu/ncu_probe.py --run-ncu OUTDIR [--source] [CASE ...]
    python3 tests/gpu/ncu_probe.py --summarize OUTDIR  # one block per kernel: FIGURES, the top stalls
    python3 tests/gpu/ncu_probe.py --stalls OUTDIR/CASE.sass.csv  # where the warps' stall samples fall

Cases: ``prefill-M-N-K`` (``_prefill_kernel`` forced, int4 g128), ``bf16-M-N-K`` (cuBLAS, ``x @ w.t()``),
``decode-M-N-K`` (the skinny / FMA kernel as ``quant_matmul`` picks it), ``gluon-M-N-K[-tTILING]`` (the Gluon
kernel forced: stream-K decode up to 64 rows, the prefill GEMM past that, at ``quant_matmul.gluon_tiles``'
tiling or, with ``-t``, at TILING as gluon_prefill_probe.py writes it, dots for its colons:
``gluon-384-6144-4096-t256.4.1`` a tile a program, ``-t256.4.p132`` stream-K, ``-t256.4.p132w-1`` whole waves
first), ``auto-M-N-K`` (what quant_matmul picks), ``machete-M-N-K`` and ``marlin-M-N-K`` (vLLM's W4A16
kernels on the same weight re-quantized; vLLM staged). The weight is int4 g128 unless the name ends in
``-gGROUP[z][o]`` (before any tiling): ``-g32`` groups of 32, ``z`` with zero points, ``o`` on owned words
(quant_matmul_owned, as the vLLM method serves them on Hopper): ``auto-4-14336-4096-g32zo``. Any M, N, K
parse; ``--list`` gives the ones the 2026-11-25 reports hold.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

import squeezeserve.kernels as K
from squeezeserve.kernels import quant_layout
from squeezeserve.kernels.ops import quant_matmul as qm

DTYPE = torch.bfloat16
SECTIONS = (
    "SpeedOfLight",
    "LaunchStats",
    "Occupancy",
    "WarpStateStats",
    "SchedulerStats",
    "ComputeWorkloadAnalysis",
    "MemoryWorkloadAnalysis",
)
CASES = (
    "prefill-128-14336-14336",
    "bf16-128-14336-14336",
    "prefill-512-4096-14336",
    "bf16-512-4096-14336",
    "prefill-512-14336-14336",
    "bf16-512-14336-14336",
    "prefill-2048-14336-14336",
    "bf16-2048-14336-14336",
    "decode-16-14336-14336",
    "decode-16-4096-14336",
    "decode-16-14336-4096",
    "decode-16-14336-14336-g32z",
    "bf16-16-14336-14336",
    "gluon-16-14336-14336",
    "gluon-64-14336-14336",
    "gluon-128-14336-14336",
    "gluon-512-14336-14336",
    "gluon-512-4096-14336",
)


# Bytes of spilled registers (local memory) loaded and stored: ncu prints these as metrics of their own.
LOCAL = ("l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum", "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum")
# What --summarize reads from each kernel's report (the sections' names for them).
FIGURES = (
    "Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput", "Tensor (All)", "ALU",
    "Waves Per SM", "Grid Size", "Block Size", "Registers Per Thread", "Dynamic Shared Memory Per Block",
    "Theoretical Occupancy", "Achieved Occupancy", "Issue Slots Busy", "Eligible Warps Per Scheduler",
    "L2 Hit Rate", *LOCAL,
)  # fmt: skip


def summarize(path: Path) -> str:
    """The FIGURES and the five largest warp stalls (cycles per issued instruction) of each kernel in one
    ncu text report (``--print-details all``)."""
    header = r"\n  (\S.*?) \((\d+, \d+, \d+)\)x\((\d+, \d+, \d+)\), Context[^\n]*"
    parts = re.split(header, path.read_text())
    lines = [f"== {path.stem}"]
    for i in range(1, len(parts), 4):
        body = parts[i + 3]
        figures = []
        for name in FIGURES:
            hit = re.search(rf"^\s+{re.escape(name)}\s+(\S+(?:/\S+)?\s+)?([\d,.]+)\s*$", body, re.M)
            if hit:
                figures.append(f"{name} {hit.group(2)}{(' ' + hit.group(1).strip()) if hit.group(1) else ''}")
        stalls = sorted(
            ((float(v), s) for s, v in re.findall(r"Stall ([A-Za-z ]+?)\s+inst\s+([\d.]+)", body))
        )
        lines.append(f"  {parts[i][:100]} grid ({parts[i + 1]}) x ({parts[i + 2]})")
        lines.append("    " + "; ".join(figures))
        lines.append("    stalls: " + ", ".join(f"{s} {v}" for v, s in stalls[::-1][:5]))
    return "\n".join(lines)


def stalls(path: Path, top: int = 25) -> str:
    """Where a kernel's warp stall samples fall (a ``--source`` run's CASE.sass.csv): the ``top`` SASS
    instructions by samples, each with its three largest stall reasons, then the samples by opcode, by
    reason and by how many times each instruction ran (a loop's body, the idle warps, the loading warp: each
    a group), as shares of all samples (the idle warps of the loading warp's warpgroup included: they wait
    at a barrier the whole kernel)."""
    rows = list(csv.reader(path.open()))
    head_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    head = rows[head_at]
    data = [dict(zip(head, r, strict=True)) for r in rows[head_at + 1 :] if len(r) == len(head)]

    def num(v: str) -> float:
        return float(v.replace(",", "")) if v else 0.0

    samples = "Warp Stall Sampling (All Samples)"
    total = sum(num(d[samples]) for d in data) or 1.0
    reasons = [c for c in head if c.startswith("stall_") and "Not Issued" not in c]
    lines = [f"== {path.name}: {len(data)} instructions, {total:.0f} samples"]
    for d in sorted(data, key=lambda d: -num(d[samples]))[:top]:
        most = sorted(((num(d[c]), c[6:]) for c in reasons), reverse=True)[:3]
        why = ", ".join(f"{r} {v / total * 100:.1f}" for v, r in most if v)
        share = num(d[samples]) / total * 100
        lines.append(f"  {share:5.1f}% {d['Source'][:64]:64s} x{d['Instructions Executed']} | {why}")
    by_op: dict[str, float] = {}
    by_reason: dict[str, float] = {}
    for d in data:
        words = [w for w in d["Source"].split() if not w.startswith("@")]
        op = words[0].split(".")[0] if words else "?"
        by_op[op] = by_op.get(op, 0.0) + num(d[samples])
        for c in reasons:
            by_reason[c[6:]] = by_reason.get(c[6:], 0.0) + num(d[c])
    for name, shares in (("by opcode", by_op), ("by reason", by_reason)):
        ranked = sorted(shares.items(), key=lambda kv: -kv[1])[:14]
        lines.append(f"  {name}: " + ", ".join(f"{k} {v / total * 100:.1f}%" for k, v in ranked))
    # Instructions executed equally often are one stretch of code (a loop's body, the idle warps' wait, the
    # loading warp's): each such group's samples and their reasons.
    groups: dict[float, dict[str, float]] = {}
    for d in data:
        group = groups.setdefault(num(d["Instructions Executed"]), {"": 0.0, "#": 0.0})
        group[""] += num(d[samples])
        group["#"] += 1
        for c in reasons:
            group[c[6:]] = group.get(c[6:], 0.0) + num(d[c])
    lines.append("  by times executed (a group: the instructions run that many times, warps summed):")
    for times, group in sorted(groups.items(), key=lambda kv: -kv[1][""])[:6]:
        why = sorted(((v, r) for r, v in group.items() if r not in ("", "#") and v), reverse=True)[:8]
        lines.append(f"    x{times:.0f} ({group['#']:.0f} instructions) {group[''] / total * 100:.1f}%: "
                     + ", ".join(f"{r} {v / total * 100:.1f}" for v, r in why))  # fmt: skip
    return "\n".join(lines)


def split_tiling(name: str) -> tuple[str, dict | None]:
    """A case's name without its ``-tTILING`` suffix, and the Gluon prefill tiling that suffix gives."""
    name, _, spec = name.partition("-t")
    if not spec:
        return name, None
    sys.path.insert(0, str(Path(__file__).parent))
    from gluon_prefill_probe import tiling

    return name, tiling(spec.replace(".", ":"))


def _case(name: str):
    """The product ``name`` names, as a no-argument callable."""
    name, cfg = split_tiling(name)
    if cfg is not None:  # (up to 64 rows the Gluon kernel runs as a decode: gluon_decode_tiles)
        qm.gluon_tiles = qm.gluon_decode_tiles = lambda *_: dict(cfg)
    kind, *dims = name.split("-")
    fmt = dims.pop() if not dims[-1].isdigit() else "g128"
    m, n, k = (int(d) for d in dims)
    parsed = re.fullmatch(r"g(\d+)(z?)(o?)", fmt)
    if parsed is None:
        raise SystemExit(f"{name}: the weight's format is gGROUP[z][o], got {fmt!r}")
    group, zeros, owned = int(parsed[1]), bool(parsed[2]), bool(parsed[3])
    x = torch.randn(m, k, device="cuda", dtype=DTYPE)
    weight = torch.randn(n, k, device="cuda", dtype=DTYPE) / 64
    if kind == "bf16":
        return lambda: x @ weight.t()
    if kind in ("machete", "marlin"):
        return _vllm_case(kind, x, weight, group, zeros)
    t = quant_layout.pack_weight(weight, 4, group, symmetric=not zeros)
    qw, sc, zp = t["weight_packed"], t["weight_scale"], t.get("weight_zero_point")
    qm.PREFILL, qm.DECODE = {
        "prefill": ("triton", "triton"),
        "gluon": ("gluon", "gluon"),
        "auto": ("auto", "auto"),
    }.get(kind, ("auto", "triton"))
    if owned:  # the words and zero points as the vLLM method repacks them on Hopper
        qw = quant_layout.to_owned_order(qw)
        zp = quant_layout.to_owned_zeros(zp, n) if zp is not None else None
        return lambda: torch.ops.squeezeserve.quant_matmul_owned(x, qw, sc, zp, group)
    return lambda: K.quant_matmul(x, qw, sc, zp, group, 4)


def _vllm_case(kind: str, x, weight, group: int, zeros: bool):
    """vLLM's Machete (symmetric only) or Marlin GEMM of ``weight`` re-quantized, as bench_quant_matmul.py's
    timers call them."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils import marlin_utils as mu

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from bench_quant_matmul import machete_pack, marlin_pack

    n, k = weight.shape
    if kind == "machete":
        if zeros:
            raise SystemExit("machete cases are symmetric (Machete is item 2's peer, Marlin item 1's)")
        wtype, b, w_s = machete_pack(weight, group)
        return lambda: ops.machete_mm(a=x, b_q=b, b_type=wtype, b_group_scales=w_s, b_group_size=group)
    wtype, q_w, s, zp, g_idx, sort_idx = marlin_pack(weight, group, zeros)
    ws = mu.marlin_make_workspace_new(x.device)
    return lambda: mu.apply_gptq_marlin_linear(x, q_w, s, zp, g_idx, sort_idx, ws, wtype, n, k, True)


def run_case(name: str) -> None:
    fn = _case(name)
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("prof")
    fn()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


def run_ncu(out: Path, cases, source: bool = False) -> int:
    """Each case under ncu: its sections' report (CASE.txt); with ``source`` also its SASS with the warp
    stall samples of each instruction (CASE.sass.csv, ncu's source page)."""
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    base = ["ncu", "--clock-control", "none", "--nvtx", "--nvtx-include", "prof/"]
    for name in cases:
        cmd = base + ["--print-details", "all", "--metrics", ",".join(LOCAL)]
        for s in SECTIONS:
            cmd += ["--section", s]
        r = subprocess.run(
            cmd + [sys.executable, __file__, name], capture_output=True, text=True, env=os.environ
        )
        (out / f"{name}.txt").write_text(r.stdout + ("\n# stderr\n" + r.stderr if r.returncode else ""))
        if source and r.returncode == 0:
            cmd = base + ["--section", "SourceCounters", "--section", "WarpStateStats", "--page", "source"]
            cmd += ["--print-source", "sass", "--csv", sys.executable, __file__, name]
            r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
            (out / f"{name}.sass.csv").write_text(
                r.stdout + ("\n# stderr\n" + r.stderr if r.returncode else "")
            )
        print(f"{name}: rc={r.returncode}", flush=True)
        failed += r.returncode != 0
    return failed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="*")
    p.add_argument("--list", action="store_true")
    p.add_argument("--run-ncu", metavar="OUTDIR")
    p.add_argument(
        "--source", action="store_true", help="with --run-ncu: each instruction's stall samples too"
    )
    p.add_argument("--summarize", metavar="OUTDIR")
    p.add_argument("--stalls", metavar="CSV", help="a --source run's CASE.sass.csv")
    a = p.parse_args()
    if a.list:
        print("\n".join(CASES))
    elif a.stalls:
        print(stalls(Path(a.stalls)))
    elif a.summarize:
        print("\n".join(summarize(f) for f in sorted(Path(a.summarize).glob("*.txt"))))
    elif a.run_ncu:
        sys.exit(1 if run_ncu(Path(a.run_ncu), a.cases or CASES, a.source) else 0)
    else:
        for name in a.cases:
            run_case(name)


if __name__ == "__main__":
    main()
