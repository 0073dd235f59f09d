"""Start ``vllm serve`` for a GPU worker with the same OpenAI surface as the embedded worker."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping


def vllm_command(model: str, name: str, host: str, port: int, dtype: str, extra: list[str]) -> list[str]:
    """The ``vllm serve`` command line; ``extra`` (anything after ``--``) is passed through unchanged."""
    exe = shutil.which("vllm")
    base = [exe] if exe else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    cmd = [*base, "serve", model, "--host", host, "--port", str(port), "--served-model-name", name]
    if dtype != "auto":
        cmd += ["--dtype", dtype]
    return cmd + extra


def vllm_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` plus the compile-cache root of the plugin's op switches (``VLLM_CACHE_ROOT``)."""
    from squeezeserve.service.worker.vllm_plugin import compile_cache_root

    return {**environ, "VLLM_CACHE_ROOT": compile_cache_root(environ)}


def exec_vllm(model: str, name: str, host: str, port: int, dtype: str, extra: list[str]) -> int:
    """Replace this process with vLLM, so signals and exit codes reach it directly (containers, probes)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print(
            "error: --engine vllm needs vLLM: pip install 'squeezeserve[vllm]' on a GPU host", file=sys.stderr
        )
        return 1
    cmd = vllm_command(model, name, host, port, dtype, extra)
    os.execvpe(cmd[0], cmd, vllm_environment(os.environ))
    return 0  # not reached
