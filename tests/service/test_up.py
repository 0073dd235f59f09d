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


def test_ctrl_c_drains_a_stream_and_a_second_one_exits_at_once(
    baseline_dir: Path, servers: SimpleNamespace
) -> None:
    """First SIGINT: the gateway says it is draining and keeps the open stream going; second: exit now,
    worker gone, no traceback. ``--threads`` reaches the worker (its start line names it)."""
    port, worker_port = servers.free_port(), servers.free_port()
    command = [sys.executable, "-m", "squeezeserve.service.cli", "--log-level", "INFO", "up"]
    command += ["--port", str(port), "--worker-port", str(worker_port), "--threads", "1"]
    command += ["--model", str(baseline_dir), "--served-model-name", "m"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    gateway = f"http://127.0.0.1:{port}"
    try:
        servers.wait_until_healthy(gateway, timeout=300, process=process)
        body = {
            "model": "m",
            "prompt": "Once upon a time",
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{gateway}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            process.send_signal(signal.SIGINT)
            # still streaming after the first Ctrl-C: the next events arrive
            assert sum(1 for _, line in zip(range(5), lines, strict=False) if line.startswith("data: ")) >= 2
            assert process.poll() is None
            process.send_signal(signal.SIGINT)
            output, _ = process.communicate(timeout=15)
    finally:
        servers.stop_process(process, signal.SIGKILL)
    assert process.returncode == 130
    assert "torch threads: 1" in output
    assert "gateway draining: 1 request(s) in flight" in output and "second interrupt, exiting now" in output
    assert "Traceback" not in output
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{worker_port}/health", timeout=2)
