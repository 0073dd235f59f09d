"""A worker subprocess for a local checkpoint, for the length of one latency sweep."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from squeezeserve.service.processes import free_port, stop_process, wait_until_healthy
from squeezeserve.service.worker.settings import WorkerSettings

START_TIMEOUT_S = 600.0  # model load on a busy CPU, or vLLM's compile and warm-up


def peak_rss_bytes(pid: int) -> int | None:
    """The process's peak resident set (Linux ``VmHWM``), or None where /proc does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class WorkerProcess:
    """``squeezeserve worker --engine ENGINE`` on a free loopback port; a context manager."""

    def __init__(
        self, model: Path, name: str, engine: str, dtype: str, max_batch_size: int, **options: object
    ) -> None:
        """``options``: further :class:`WorkerSettings` fields (``decoder``, ``threads``, ...)."""
        self.port = free_port()
        self.name = name
        self.url = f"http://127.0.0.1:{self.port}"
        settings = WorkerSettings(
            model=str(model),
            served_model_name=name,
            engine=engine,
            port=self.port,
            dtype=dtype,
            max_batch_size=max_batch_size,
            **options,
        )
        self.command = [sys.executable, "-m", "squeezeserve.service.cli", "--log-level", "WARNING", "worker"]
        self.command += settings.flags()
        self.process: subprocess.Popen | None = None
        self.peak_rss: int | None = None

    def __enter__(self) -> WorkerProcess:
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL)
        try:
            wait_until_healthy(self.url, START_TIMEOUT_S, self.process)
        except RuntimeError:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        process = self.process
        if process is None:
            return
        # vLLM runs the model in child processes; the worker's own high-water mark is what /proc gives.
        self.peak_rss = peak_rss_bytes(process.pid)
        stop_process(process)
