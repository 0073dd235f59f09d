"""A worker subprocess for a local checkpoint, for the length of one latency sweep."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

START_TIMEOUT_S = 600.0  # model load on a busy CPU, or vLLM's compile and warm-up


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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

    def __init__(self, model: Path, name: str, engine: str, dtype: str, max_batch_size: int) -> None:
        self.port = _free_port()
        self.name = name
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "squeezeserve.service.cli", "--log-level", "WARNING", "worker"]
        self.command += ["--engine", engine, "--model", str(model), "--port", str(self.port)]
        self.command += ["--served-model-name", name, "--dtype", dtype]
        if engine == "local":
            self.command += ["--max-batch-size", str(max_batch_size)]
        self.process: subprocess.Popen | None = None
        self.peak_rss: int | None = None

    def __enter__(self) -> WorkerProcess:
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the worker exited with code {self.process.returncode} while starting")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise RuntimeError(f"the worker was not healthy after {START_TIMEOUT_S:.0f} s")

    def __exit__(self, *exc: object) -> None:
        process = self.process
        if process is None:
            return
        # vLLM runs the model in child processes; the worker's own high-water mark is what /proc gives.
        self.peak_rss = peak_rss_bytes(process.pid)
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
