"""``squeezeserve up``: one command brings up a worker and the gateway; SIGTERM stops both."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow


def test_up_serves_chat_and_stops_cleanly(baseline_dir: Path, servers: SimpleNamespace) -> None:
    port, worker_port = servers.free_port(), servers.free_port()
    env = dict(os.environ)
    if (baseline_dir / "squeeze-baseline.json").is_file():
        # `up` exports the baseline into $SQUEEZESERVE_HOME/models/<name>; point it at the one we have.
        env["SQUEEZESERVE_HOME"] = str(baseline_dir.parent.parent)
    command = [sys.executable, "-m", "squeezeserve.service.cli", "up", "--port", str(port)]
    command += ["--worker-port", str(worker_port)]
    if not (baseline_dir / "squeeze-baseline.json").is_file():
        command += ["--model", str(baseline_dir), "--served-model-name", "smollm2-135m-instruct"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    gateway = f"http://127.0.0.1:{port}"
    try:
        servers.wait_until_healthy(gateway, timeout=300, process=process)
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
        )
        assert "Paris" in reply.choices[0].message.content
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        servers.stop_process(process, signal.SIGKILL)
    assert "squeezeserve is up" in output and "stopping worker" in output
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{worker_port}/health", timeout=2)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{gateway}/livez", timeout=2)
