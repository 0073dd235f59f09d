"""Print the third-party requirements of squeezeserve's base install plus the given extras, one a line.

The images install these in a layer of their own before copying the source, so a code change reuses the
cached dependency layers and only reinstalls the package itself (``pip install --no-deps .``). Extras that
name ``squeezeserve[...]`` are expanded; unknown extras are an error.

    python docker/requirements.py pyproject.toml cpu compress validate > requirements.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

SELF_REFERENCE = re.compile(r"^squeezeserve\[(?P<extras>[^\]]+)\]$")


def requirements(project: dict, extras: list[str]) -> list[str]:
    """The base dependencies, then each extra's, in order, without duplicates."""
    optional = project.get("optional-dependencies", {})
    found: list[str] = list(project.get("dependencies", []))
    pending, seen = list(extras), set()
    while pending:
        extra = pending.pop(0)
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"unknown extra {extra!r}; pyproject.toml defines {', '.join(sorted(optional))}")
        seen.add(extra)
        for spec in optional[extra]:
            nested = SELF_REFERENCE.match(spec.replace(" ", ""))
            if nested:
                pending.extend(nested["extras"].split(","))
            elif spec not in found:
                found.append(spec)
    return found


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: requirements.py PYPROJECT [EXTRA ...]")
    project = tomllib.loads(Path(argv[0]).read_text())["project"]
    sys.stdout.write("".join(f"{spec}\n" for spec in requirements(project, argv[1:])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
