"""The flat metric names of ``report.json["metrics"]``: what gates test and the Markdown table shows.

Accuracy: ``ppl_baseline``, ``ppl_candidate``, ``ppl_ratio`` (candidate / baseline), ``ln_ppl_ratio``,
``top1_agreement``; ``kl_mean`` and ``kl_p99`` when both sides are local; ``task_acc_baseline``,
``task_acc_candidate`` and ``task_acc_delta`` (candidate - baseline) with ``--task``.
Size (local sides): ``checkpoint_bytes_<side>``, ``weights_bytes_<side>``, ``peak_rss_bytes_<side>``
(the worker process's, after the latency run) and their ``_ratio``.
Latency, per concurrency level N as ``<name>@cN`` and, unqualified, at the lowest level swept:
``<t>_<s>_ms_<side>`` and ``<t>_<s>_ratio`` for t in ttft, tpot, itl, e2e and s in mean, p50, p90, p99;
``request_throughput_<side>``, ``output_throughput_<side>`` (tokens/s), ``goodput_<side>`` (requests/s
meeting the SLO; with --slo-*), ``error_rate_<side>``, and the throughputs' ``_ratio``.
<side> is ``baseline`` or ``candidate``; every ratio is candidate / baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

from squeezeserve.service.validate.latency import STATS, TIMINGS

SIDES = ("baseline", "candidate")
SIZE_METRICS = ("checkpoint_bytes", "weights_bytes", "peak_rss_bytes")
THROUGHPUTS = ("request_throughput", "output_throughput", "goodput")


@dataclass(frozen=True)
class Plan:
    """What a run will measure, known before it starts (so gates on anything else are usage errors)."""

    accuracy: bool
    exact_fidelity: bool
    task: bool
    latency: bool
    levels: tuple[int, ...]
    slo: bool
    local: tuple[bool, bool]  # baseline, candidate


def _latency_names(slo: bool) -> list[str]:
    names = [f"{t}_{s}_ms_{side}" for t in TIMINGS for s in STATS for side in SIDES]
    names += [f"{t}_{s}_ratio" for t in TIMINGS for s in STATS]
    for name in THROUGHPUTS:
        if name != "goodput" or slo:
            names += [f"{name}_{side}" for side in SIDES] + [f"{name}_ratio"]
    names += [f"error_rate_{side}" for side in SIDES]
    return names


def planned_names(plan: Plan) -> list[str]:
    names: list[str] = []
    if plan.accuracy:
        names += ["ppl_baseline", "ppl_candidate", "ppl_ratio", "ln_ppl_ratio", "top1_agreement"]
        if plan.exact_fidelity:
            names += ["kl_mean", "kl_p99"]
    if plan.task:
        names += ["task_acc_baseline", "task_acc_candidate", "task_acc_delta"]
    for metric in SIZE_METRICS:
        if metric == "peak_rss_bytes" and not plan.latency:
            continue
        names += [f"{metric}_{side}" for side, local in zip(SIDES, plan.local, strict=True) if local]
        if all(plan.local):
            names.append(f"{metric}_ratio")
    if plan.latency:
        per_level = _latency_names(plan.slo)
        names += per_level
        names += [f"{name}@c{level}" for level in plan.levels for name in per_level]
    return names


def ratio(candidate: float | None, baseline: float | None) -> float | None:
    if candidate is None or baseline is None or baseline == 0:
        return None
    return candidate / baseline


def flatten(report: dict) -> dict[str, float | None]:
    """``report.json``'s sections -> the flat metric dict (names as in the module docstring)."""
    out: dict[str, float | None] = {}
    accuracy = report.get("accuracy")
    if accuracy:
        out["ppl_baseline"] = accuracy["baseline"]["perplexity"]
        out["ppl_candidate"] = accuracy["candidate"]["perplexity"]
        out["ppl_ratio"] = ratio(out["ppl_candidate"], out["ppl_baseline"])
        fidelity = accuracy["fidelity"]
        out["ln_ppl_ratio"] = fidelity["ln_ppl_ratio"]
        out["top1_agreement"] = fidelity["top1_agreement"]
        if fidelity["kl_mean"] is not None:
            out["kl_mean"], out["kl_p99"] = fidelity["kl_mean"], fidelity["kl_p99"]
    task = report.get("task")
    if task:
        out["task_acc_baseline"] = task["baseline"]
        out["task_acc_candidate"] = task["candidate"]
        out["task_acc_delta"] = task["candidate"] - task["baseline"]
    sizes = report.get("size", {})
    for metric in SIZE_METRICS:
        values = {side: sizes.get(side, {}).get(metric) for side in SIDES}
        for side, value in values.items():
            if value is not None:
                out[f"{metric}_{side}"] = value
        if all(v is not None for v in values.values()):
            out[f"{metric}_ratio"] = ratio(values["candidate"], values["baseline"])
    latency = report.get("latency")
    if latency:
        rows = {side: {row["concurrency"]: row for row in latency[side]} for side in SIDES}
        levels = sorted(rows["baseline"])
        for level in levels:
            level_values = _level(rows["baseline"][level], rows["candidate"].get(level, {}))
            out.update({f"{k}@c{level}": v for k, v in level_values.items()})
            if level == levels[0]:
                out.update(level_values)
    return out


def _level(base: dict, cand: dict) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    keys = [f"{t}_{s}_ms" for t in TIMINGS for s in STATS]
    for key in keys:
        out[f"{key}_baseline"], out[f"{key}_candidate"] = base.get(key), cand.get(key)
        out[key.removesuffix("_ms") + "_ratio"] = ratio(cand.get(key), base.get(key))
    for name in THROUGHPUTS:
        if base.get(name) is None and cand.get(name) is None:
            continue
        out[f"{name}_baseline"], out[f"{name}_candidate"] = base.get(name), cand.get(name)
        out[f"{name}_ratio"] = ratio(cand.get(name), base.get(name))
    out["error_rate_baseline"], out["error_rate_candidate"] = base.get("error_rate"), cand.get("error_rate")
    return out
