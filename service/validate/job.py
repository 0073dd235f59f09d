"""The validation job, stage by stage: check everything it can up front, then accuracy, size, latency,
gates and the report. Usage problems raise ``UsageError`` before any model is loaded."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from squeezeserve.service.models import size
from squeezeserve.service.validate import data, gates, metrics, plots, report
from squeezeserve.service.validate.latency import LoadSettings, sweep
from squeezeserve.service.validate.specs import ModelSpec, UsageError

log = logging.getLogger(__name__)
ROLES = ("baseline", "candidate")


@dataclass(frozen=True)
class JobConfig:
    baseline: ModelSpec
    candidate: ModelSpec
    dataset: str
    out: Path
    gates: list[gates.Gate]
    api_key: str | None
    tokenizer: str | None
    window: int
    stride: int
    max_tokens: int | None
    task: str | None
    skip_accuracy: bool
    skip_latency: bool
    load: LoadSettings
    prompt_tokens: int
    engine: str
    dtype: str
    device: str

    def plan(self) -> metrics.Plan:
        local = (self.baseline.is_local, self.candidate.is_local)
        return metrics.Plan(
            accuracy=not self.skip_accuracy,
            exact_fidelity=all(local),
            task=self.task is not None and not self.skip_accuracy,
            latency=not self.skip_latency,
            levels=tuple(self.load.concurrency),
            slo=self.load.slo_ttft_ms is not None or self.load.slo_tpot_ms is not None,
            local=local,
        )


class Job:
    def __init__(self, config: JobConfig, console: Console | None = None) -> None:
        self.config = config
        self.console = console or Console(stderr=True)
        self.report: dict[str, Any] = {}
        self.kl_per_token: list[float] | None = None

    # -- checks before any work ------------------------------------------------------------------
    def preflight(self) -> tuple[Any, list[int], list[data.TaskItem] | None]:
        cfg = self.config
        gates.check_names(cfg.gates, metrics.planned_names(cfg.plan()))
        tokenizer = self._tokenizer()
        for spec in (cfg.baseline, cfg.candidate):
            if not spec.is_local:
                from squeezeserve.service.validate.accuracy import HttpScorer

                scorer = HttpScorer(spec, cfg.api_key)
                try:
                    scorer.check()
                finally:
                    scorer.close()
        text = data.read_text(cfg.dataset)
        need = cfg.max_tokens
        if need is not None and not cfg.skip_latency:
            need = max(need, cfg.prompt_tokens * 16)  # room for distinct latency prompts
        ids = data.tokenize(tokenizer, text, need)
        if len(ids) < 2:
            raise UsageError(f"--dataset {cfg.dataset} has fewer than 2 tokens")
        items = data.read_task(cfg.task) if cfg.task and not cfg.skip_accuracy else None
        if not cfg.skip_accuracy:
            data.sliding_windows(ids[: cfg.max_tokens], cfg.window, cfg.stride)  # checks the flags
        return tokenizer, ids, items

    def _tokenizer(self) -> Any:
        cfg = self.config
        source = next((str(s.path) for s in (cfg.baseline, cfg.candidate) if s.is_local), cfg.tokenizer)
        if source is None:
            raise UsageError(
                "both sides are endpoints: name a tokenizer with --tokenizer (checkpoint dir or id)"
            )
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot load the tokenizer from {source}: {exc}") from exc

    # -- stages ----------------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.config
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress
        tokenizer, ids, items = self.preflight()
        cfg.out.mkdir(parents=True, exist_ok=True)
        self.report = {
            "schema": 1,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "baseline": {"spec": cfg.baseline.label, "local": cfg.baseline.is_local},
            "candidate": {"spec": cfg.candidate.label, "local": cfg.candidate.is_local},
            "settings": self._settings(),
        }
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
        ) as progress:
            if not cfg.skip_accuracy:
                self._accuracy(progress, tokenizer, ids[: cfg.max_tokens], items)
            self.report["size"] = self._sizes()
            if not cfg.skip_latency:
                self._latency(progress, ids)
        return self._finish()

    def _settings(self) -> dict:
        cfg = self.config
        return {
            "dataset": cfg.dataset,
            "window": cfg.window,
            "stride": cfg.stride,
            "max_tokens": cfg.max_tokens,
            "task": cfg.task,
            "engine": cfg.engine,
            "dtype": cfg.dtype,
            "device": cfg.device,
            "prompt_tokens": cfg.prompt_tokens,
            **{k: v for k, v in asdict(cfg.load).items() if k != "timeout_s"},
        }

    def _scorer(self, spec: ModelSpec) -> Any:
        from squeezeserve.service.validate.accuracy import HttpScorer, LocalScorer

        if spec.is_local:
            return LocalScorer.load(spec.path, self.config.dtype, self.config.device)
        return HttpScorer(spec, self.config.api_key)

    def _accuracy(self, progress: Progress, tokenizer: Any, ids: list[int], items: Any) -> None:
        from squeezeserve.service.validate import accuracy

        cfg = self.config
        windows = data.sliding_windows(ids, cfg.window, cfg.stride)
        scorers = [self._scorer(spec) for spec in (cfg.baseline, cfg.candidate)]
        task = progress.add_task("perplexity", total=sum(w.scored for w in windows))
        side_b, side_c, fidelity = accuracy.compare(*scorers, windows, lambda n: progress.advance(task, n))
        self.kl_per_token = fidelity.kl_per_token
        fidelity.kl_per_token = None
        self.report["accuracy"] = {
            "baseline": asdict(side_b),
            "candidate": asdict(side_c),
            "fidelity": asdict(fidelity),
        }
        del self.report["accuracy"]["fidelity"]["kl_per_token"]
        for side in ("baseline", "candidate"):
            del self.report["accuracy"][side]["task_accuracy"]
        if items:
            scores = {}
            for role, scorer in zip(ROLES, scorers, strict=True):
                t = progress.add_task(f"task {role}", total=len(items))
                scores[role] = accuracy.task_accuracy(
                    scorer, tokenizer, items, lambda n, t=t: progress.advance(t, n)
                )
            self.report["task"] = {**scores, "items": len(items), "file": cfg.task}
        for scorer in scorers:
            if isinstance(scorer, accuracy.HttpScorer):
                scorer.close()
        del scorers
        gc.collect()

    def _sizes(self) -> dict:
        out = {}
        for role, spec in zip(ROLES, (self.config.baseline, self.config.candidate), strict=True):
            if spec.path is not None:
                out[role] = {
                    "checkpoint_bytes": size.checkpoint_bytes(spec.path),
                    "weights_bytes": size.weights_bytes(spec.path),
                }
        return out

    def _latency(self, progress: Progress, ids: list[int]) -> None:
        from squeezeserve.service.validate.server import WorkerProcess

        cfg = self.config
        length = cfg.prompt_tokens
        span = max(1, len(ids) - length)

        def prompt(index: int) -> list[int]:
            # distinct slices of the dataset, so no prefix cache serves one request from another's
            start = (index * length) % span
            chunk = ids[start : start + length]
            return (chunk * (length // max(1, len(chunk)) + 1))[:length]

        self.report["latency"] = {}
        for role, spec in zip(ROLES, (cfg.baseline, cfg.candidate), strict=True):
            task = progress.add_task(f"latency {role}: starting", total=None)

            def on_level(concurrency: int, total: int, task=task, role=role) -> None:
                progress.reset(task, total=total, description=f"latency {role} c={concurrency}")

            def on_done(task=task) -> None:
                progress.advance(task)

            if spec.path is not None:
                with WorkerProcess(
                    spec.path, f"validate-{role}", cfg.engine, cfg.dtype, max(cfg.load.concurrency)
                ) as worker:
                    rows = asyncio.run(
                        sweep(f"{worker.url}/v1", worker.name, None, prompt, cfg.load, on_level, on_done)
                    )
                self.report["size"].setdefault(role, {})["peak_rss_bytes"] = worker.peak_rss
            else:
                rows = asyncio.run(
                    sweep(
                        spec.base_url or "",
                        spec.model or "",
                        cfg.api_key,
                        prompt,
                        cfg.load,
                        on_level,
                        on_done,
                    )
                )
            self.report["latency"][role] = rows

    def _finish(self) -> dict:
        cfg = self.config
        flat = metrics.flatten(self.report)
        self.report["metrics"] = flat
        self.report["gates"] = gates.evaluate(cfg.gates, flat)
        self.report["passed"] = all(g["passed"] for g in self.report["gates"])
        written = []
        if "latency" in self.report:
            written.append(plots.latency_plot(self.report["latency"], cfg.out))
        if "accuracy" in self.report:
            written.append(plots.accuracy_plot(self.report["accuracy"], self.kl_per_token, cfg.out))
        self.report["plots"] = [p.name for p in written]
        report.write_json(self.report, cfg.out)
        report.write_markdown(self.report, cfg.out)
        return self.report
