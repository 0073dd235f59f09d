"""``report.json`` (every number) and ``report.md`` (one table baseline vs candidate, then the gates)."""

from __future__ import annotations

import json
from pathlib import Path

from squeezeserve.service.validate.metrics import ratio

_MIB = 1024 * 1024


def write_json(report: dict, out: Path) -> Path:
    path = out / "report.json"
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    return path


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}" if abs(value) >= 0.01 or value == 0 else f"{value:.2e}"


def _row(name: str, base: float | None, cand: float | None, digits: int = 3) -> str:
    return f"| {name} | {_fmt(base, digits)} | {_fmt(cand, digits)} | {_fmt(ratio(cand, base))} |"


def _fidelity_row(name: str, value: float | None) -> str:
    return f"| {name} | — | {_fmt(value, 4)} | — |"


def markdown(report: dict) -> str:
    """The human report: one table (baseline, candidate, candidate/baseline) and the gate results."""
    lines = ["# squeezeserve validate", ""]
    lines.append(f"- baseline: `{report['baseline']['spec']}`")
    lines.append(f"- candidate: `{report['candidate']['spec']}`")
    settings = report["settings"]
    if "accuracy" in report:
        acc = report["accuracy"]
        lines.append(
            f"- accuracy: `{settings['dataset']}`, {acc['baseline']['tokens']} scored tokens, window "
            f"{settings['window']}, stride {settings['stride']}; fidelity: {acc['fidelity']['method']}"
        )
    if "latency" in report:
        lines.append(
            f"- latency: {settings['prompt_tokens']} prompt + {settings['output_tokens']} output tokens, "
            f"concurrency {', '.join(map(str, settings['concurrency']))}, "
            f"{settings['requests_per_level'] or '4 x c (>= 8)'} requests per level after warm-up"
        )
    lines += ["", "| metric | baseline | candidate | candidate / baseline |", "|---|---:|---:|---:|"]
    if "accuracy" in report:
        acc = report["accuracy"]
        lines.append(_row("perplexity", acc["baseline"]["perplexity"], acc["candidate"]["perplexity"], 4))
        fid = acc["fidelity"]
        lines.append(_fidelity_row("ln(PPL ratio)", fid["ln_ppl_ratio"]))
        lines.append(_fidelity_row("KL mean (baseline→candidate)", fid["kl_mean"]))
        lines.append(_fidelity_row("KL p99", fid["kl_p99"]))
        lines.append(_fidelity_row("top-1 agreement", fid["top1_agreement"]))
    if "task" in report:
        lines.append(_row("task accuracy", report["task"]["baseline"], report["task"]["candidate"]))
    sizes = report.get("size", {})
    for key, label in (
        ("checkpoint_bytes", "checkpoint on disk (MiB)"),
        ("weights_bytes", "stored tensors (MiB)"),
        ("peak_rss_bytes", "worker peak RSS (MiB)"),
    ):
        base, cand = sizes.get("baseline", {}).get(key), sizes.get("candidate", {}).get(key)
        if base is not None or cand is not None:
            lines.append(_row(label, base / _MIB if base else None, cand / _MIB if cand else None, 1))
    if "latency" in report:
        cand_rows = {row["concurrency"]: row for row in report["latency"]["candidate"]}
        for base in report["latency"]["baseline"]:
            level = base["concurrency"]
            cand = cand_rows.get(level, {})
            for key, label in (
                ("ttft_p50_ms", "TTFT p50 (ms)"),
                ("ttft_p99_ms", "TTFT p99 (ms)"),
                ("tpot_p50_ms", "TPOT p50 (ms)"),
                ("tpot_p99_ms", "TPOT p99 (ms)"),
                ("itl_p50_ms", "ITL p50 (ms)"),
                ("e2e_p50_ms", "E2E p50 (ms)"),
                ("e2e_p99_ms", "E2E p99 (ms)"),
                ("output_throughput", "output tokens/s"),
                ("request_throughput", "requests/s"),
                ("goodput", "goodput (req/s in SLO)"),
                ("errors", "errors"),
            ):
                if base.get(key) is not None or cand.get(key) is not None:
                    lines.append(_row(f"c={level} {label}", base.get(key), cand.get(key), 1))
    lines.append("")
    gates = report.get("gates", [])
    if gates:
        lines += ["## Gates", "", "| gate | value | result | margin |", "|---|---:|---|---:|"]
        for gate in gates:
            result = "pass" if gate["passed"] else "**FAIL**"
            note = f" ({gate['note']})" if gate.get("note") else ""
            value, margin = _fmt(gate["value"], 4), _fmt(gate["margin"], 4)
            lines.append(f"| `{gate['gate']}` | {value} | {result}{note} | {margin} |")
        verdict = "all gates pass" if report["passed"] else "at least one gate failed"
        lines += ["", f"Result: {verdict}."]
    else:
        lines.append("No gates were given.")
    plots = report.get("plots", [])
    if plots:
        lines += [""] + [f"![{Path(p).stem}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def write_markdown(report: dict, out: Path) -> Path:
    path = out / "report.md"
    path.write_text(markdown(report))
    return path
