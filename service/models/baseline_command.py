"""``squeezeserve model baseline``: export the bundled GGUF as a plain Hugging Face checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", type=Path, default=None, help="output directory (default: $SQUEEZESERVE_HOME/models/...)"
    )
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--force", action="store_true", help="export again even if an up-to-date copy exists")


def run(args: argparse.Namespace) -> int:
    from squeezeserve.service.models import bundled

    try:
        result = bundled.export_baseline(args.out, dtype=args.dtype, force=args.force)
    except (bundled.BundledModelMissing, FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if result.created:
        print(f"exported baseline ({args.dtype}) to {result.path} in {result.seconds:.1f}s")
    else:
        print(f"baseline already up to date: {result.path}")
    return 0
