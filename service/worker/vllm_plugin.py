"""vLLM general plugin: puts squeezeserve's kernels inside vLLM (entry point ``vllm.general_plugins``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers) once the
``squeezeserve`` package is installed. It installs, from ``squeezeserve.kernels.vllm_ops``:

    silu_and_mul   vLLM's SiluAndMul  -> squeezeserve::silu_and_mul
    rms_norm       vLLM's RMSNorm (and its fused residual add) -> squeezeserve::rmsnorm / add_rmsnorm
    quant          the ``--quantization squeezeserve`` method: compressed-tensors int4/int8 weight-only
                   checkpoints through squeezeserve::quant_matmul (vLLM's own kernels serve the same
                   checkpoint when the flag is not given)

Each one is switched off for A/B runs by setting its variable to 0 (``SQUEEZESERVE_VLLM_SILU_AND_MUL=0``,
``SQUEEZESERVE_VLLM_RMS_NORM=0``, ``SQUEEZESERVE_VLLM_QUANT=0``); all are on by default. The variables
must reach vLLM's engine processes, which inherit the environment of ``vllm serve``. vLLM's compile cache
key does not see them, so every set of replacements needs its own cache (:func:`compile_cache_root`).

This module imports neither torch nor vLLM at import time: the gateway's image and CI import it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

SWITCHES = {
    "silu_and_mul": "SQUEEZESERVE_VLLM_SILU_AND_MUL",
    "rms_norm": "SQUEEZESERVE_VLLM_RMS_NORM",
    "quant": "SQUEEZESERVE_VLLM_QUANT",
}
_ON = {"1", "true", "yes", "on"}
_OFF = {"0", "false", "no", "off"}


def enabled_features(environ: Mapping[str, str] = os.environ) -> dict[str, bool]:
    """Which replacements to install, from the ``SQUEEZESERVE_VLLM_*`` variables (unset or empty: on)."""
    features = {}
    for feature, variable in SWITCHES.items():
        value = environ.get(variable, "").strip().lower()
        if value and value not in _ON | _OFF:
            raise ValueError(f"{variable}={environ[variable]!r}: use 1/0 (or true/false, on/off, yes/no)")
        features[feature] = value not in _OFF
    return features


def compile_cache_root(environ: Mapping[str, str] = os.environ) -> str:
    """``VLLM_CACHE_ROOT`` for the op replacements ``environ`` selects: a subfolder per set under vLLM's
    root (``$VLLM_CACHE_ROOT``, else ``$XDG_CACHE_HOME/vllm``, else ``~/.cache/vllm``).

    vLLM keys its torch.compile cache on its config, its own environment variables and the model's
    forward, not on which ``CustomOp`` classes a plugin swapped in: without this, a server started with
    our ops off could load the graph compiled with them on (or the reverse). Likewise with the chain of
    programmatic dependent launches off (``SQUEEZESERVE_PDL=off``), where the norms and SiluAndMul compile
    to other ops."""
    root = environ.get("VLLM_CACHE_ROOT") or os.path.join(
        environ.get("XDG_CACHE_HOME")
        or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache"),
        "vllm",
    )
    features = enabled_features(environ)
    ops = [op for op in ("silu_and_mul", "rms_norm") if features[op]]
    # With the PDL chain on, the compiled norms and SiluAndMul are other ops (vllm_ops.compiled_chain).
    if ops and environ.get("SQUEEZESERVE_PDL", "auto") == "off":
        ops.append("pdl-off")
    return os.path.join(root, "squeezeserve-" + ("-".join(ops) or "no-ops"))


def register() -> None:
    """The entry point vLLM calls; idempotent (vLLM may load plugins several times in one process)."""
    features = enabled_features()
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("register() is vLLM's plugin entry point, but vLLM is not installed here")
    from squeezeserve.kernels import vllm_ops

    ops = tuple(op for op in vllm_ops.CUSTOM_OPS if features[op])
    registered = vllm_ops.register_custom_ops(ops)
    if features["quant"]:
        vllm_ops.register_quantization()
    import torch

    from squeezeserve.kernels.ops import native

    if native.NATIVE_REPLAY and torch.cuda.is_available():
        native.load()  # built here (10-20 s the first time on a machine), not in the first request
    if registered:
        log.info(
            "squeezeserve plugin (pid %d): replaced %s; quantization method %s",
            os.getpid(),
            ", ".join(registered),
            "registered" if features["quant"] else "off",
        )
