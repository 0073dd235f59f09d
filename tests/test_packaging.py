"""The package's shape: one import name, nothing importable as a top-level ``kernels`` or ``service``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_no_top_level_kernels_or_service_from_this_repo() -> None:
    """Neither the install nor the test run puts the repo root on sys.path.

    (A bare ``python`` started inside the repo root always sees ./kernels through its working directory;
    the install must not add anything beyond that, which is what the subprocess checks.)
    """
    # pytest itself (importlib mode, no `pythonpath`) adds no path; `python -m pytest` adds '' (the cwd).
    assert str(REPO_ROOT) not in [os.path.abspath(p) for p in sys.path if p], (
        "the repo root is on sys.path (run `pytest`, not `python -m pytest`, from the repo root): "
        "transformers would take ./kernels for Hugging Face's kernels package"
    )
    code = (
        "import importlib.util, os, sys\n"
        "sys.path[:] = [p for p in sys.path if p not in ('', os.getcwd())]\n"
        "for name in ('kernels', 'service'):\n"
        "    spec = importlib.util.find_spec(name)\n"
        "    print(name, spec.origin if spec else None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    for line in out.stdout.splitlines():
        name, origin = line.split(" ", 1)
        assert origin == "None" or not origin.startswith(str(REPO_ROOT)), (
            f"top-level {name} resolves to {origin}"
        )


def test_squeezeserve_maps_onto_the_fixed_folders() -> None:
    assert Path(importlib.util.find_spec("squeezeserve.service").origin).parent == REPO_ROOT / "service"
    assert Path(importlib.util.find_spec("squeezeserve.kernels").origin).parent == REPO_ROOT / "kernels"


def test_every_package_folder_is_listed_in_pyproject() -> None:
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for prefix, folder in config["package-dir"].items():
        for init in (REPO_ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO_ROOT / folder)
            found.add(".".join([prefix, *rel.parts]))
    assert found == listed, (
        f"missing from pyproject: {sorted(found - listed)}; stale: {sorted(listed - found)}"
    )


def test_the_kernels_sources_compiled_at_run_time_ship_in_the_package() -> None:
    # kernels/ops/native.py compiles kernels/csrc/*.cpp where it runs: a wheel without them cannot.
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = config["package-data"]["squeezeserve.kernels"]
    sources = [p.relative_to(REPO_ROOT / "kernels") for p in (REPO_ROOT / "kernels" / "csrc").iterdir()]
    assert sources and all(any(p.match(g) for g in globs) for p in sources), (sources, globs)


def test_cli_help_lists_every_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "squeezeserve.service.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for command in ("up", "gateway", "worker", "model"):
        assert command in out.stdout
