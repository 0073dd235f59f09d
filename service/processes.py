"""Child servers: a free loopback port, waiting for ``/health``, and stopping them politely.

Used wherever squeezeserve starts a worker of its own (``squeezeserve up``, the validation job) and by
the tests. No torch here.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import httpx


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Poll ``{url}/health`` until it answers 200; fail early if ``process`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"the server for {url} exited with code {process.returncode} before it was ready"
            )
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server at {url} was not ready within {timeout:.0f} s")


def stop_process(process: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
    """Send ``sig`` and wait up to ``grace`` seconds, then kill."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
