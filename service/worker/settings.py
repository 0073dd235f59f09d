"""The worker's settings, defined once: ``squeezeserve worker`` and ``squeezeserve up`` build their flags
from this model, ``up`` and the validation job pass it on to a child worker as flags, and the embedded
app and engine read it. No torch here (``up`` runs the gateway in its own process).
"""

from __future__ import annotations

import argparse
import os
import typing
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from squeezeserve.service.models.loader import DTYPES, Dtype, QuantizedLinear
from squeezeserve.service.serving import DEFAULT_GRACE_SECONDS

Engine = Literal["local", "vllm"]
ENGINES: tuple[str, ...] = typing.get_args(Engine)
Decoder = Literal["auto", "static", "transformers"]  # local engine: see service/worker/local/decoder.py
DECODERS: tuple[str, ...] = typing.get_args(Decoder)
Compile = Literal["auto", "on", "off"]  # local engine, static decoder: torch.compile of its decode step
COMPILES: tuple[str, ...] = typing.get_args(Compile)


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: a container's cpuset, taskset), not the
    machine's: torch's default of every core oversubscribes a worker pinned to a few."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class WorkerSettings(BaseModel):
    """One worker: which model it serves, where, and how the embedded engine runs it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    served_model_name: str | None = None
    engine: Engine = "local"
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8001
    dtype: Dtype = "auto"
    # Embedded engine only (vLLM has its own flags, passed after ``--``).
    decoder: Decoder = "auto"  # auto: our static decoder for Llama models on CPU, else transformers
    compile: Compile = "auto"  # auto: off (see the README's CPU section); on: compile at start
    max_batch_size: Annotated[int, Field(ge=1)] = 16  # sequences decoded together
    max_waiting: Annotated[int, Field(ge=0)] = 256  # queued requests before 429
    threads: Annotated[int, Field(ge=1)] = Field(default_factory=available_cores)  # torch intra-op threads
    use_custom_ops: bool = True
    quantized_linear: QuantizedLinear = "auto"
    grace_seconds: Annotated[float, Field(ge=0)] = DEFAULT_GRACE_SECONDS  # drain on SIGTERM / Ctrl-C

    @property
    def served_name(self) -> str:
        """The name clients use: explicit, else the checkpoint directory's name, else the model id."""
        if self.served_model_name:
            return self.served_model_name
        path = Path(self.model)
        return path.name if path.exists() else self.model

    def flags(self) -> list[str]:
        """``squeezeserve worker`` flags that recreate these settings in a child process."""
        flags = ["--engine", self.engine, "--model", self.model, "--served-model-name", self.served_name]
        flags += ["--host", self.host, "--port", str(self.port), "--dtype", self.dtype]
        flags += ["--grace-seconds", f"{self.grace_seconds:g}"]
        if self.engine == "local":
            flags += ["--decoder", self.decoder, "--compile", self.compile]
            flags += ["--max-batch-size", str(self.max_batch_size), "--max-waiting", str(self.max_waiting)]
            flags += ["--threads", str(self.threads), "--quantized-linear", self.quantized_linear]
            if not self.use_custom_ops:
                flags.append("--no-custom-ops")
        return flags


def _default(name: str) -> object:
    field = WorkerSettings.model_fields[name]
    return field.get_default(call_default_factory=True)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags ``worker`` and ``up`` share: engine choice, dtype and the embedded engine's knobs."""
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default=_default("engine"),
        help="local: embedded CPU engine; vllm: vllm serve",
    )
    parser.add_argument("--dtype", choices=DTYPES, default=_default("dtype"))
    parser.add_argument(
        "--decoder",
        choices=DECODERS,
        default=None,
        help="local: static (our Llama decoder with a preallocated KV cache, CPU only), transformers (the "
        "Hugging Face model), or auto (default): static for Llama models on CPU, transformers otherwise",
    )
    parser.add_argument(
        "--compile",
        choices=COMPILES,
        default=None,
        help="local, static decoder: on compiles its decode step with torch.compile before serving (minutes "
        "on a small CPU the first time; faster decode), off runs it eagerly; auto (default) is off",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=_default("max_batch_size"),
        help="local: sequences decoded together (default %(default)s)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=_default("max_waiting"),
        help="local: queued requests before 429 (default %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help=f"local: torch CPU threads (default: the cores this process may use, {available_cores()} here)",
    )

    parser.add_argument(
        "--grace-seconds",
        type=float,
        default=_default("grace_seconds"),
        metavar="SECONDS",
        help="after SIGTERM / Ctrl-C: readiness and new requests answer 503 while the running ones get up to "
        "this long to finish (default %(default)g)",
    )


ENGINE_FLAGS = (
    "engine", "dtype", "decoder", "compile", "max_batch_size", "max_waiting", "threads", "grace_seconds"
)  # fmt: skip


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    """The values of :func:`add_engine_arguments`' flags the user gave, as settings fields."""
    return {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
