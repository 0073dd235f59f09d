"""Data and imports flow one way: gateway -> HTTP -> worker -> loader -> kernels. Kernels import nothing of
the service; serving code (gateway, worker, model loading) reads checkpoints without the compressor."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVING = ("service/gateway", "service/worker", "service/models")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def offending(folder: str, forbidden: str) -> list[str]:
    return [
        f"{path.relative_to(REPO_ROOT)} imports {name}"
        for path in sorted((REPO_ROOT / folder).rglob("*.py"))
        for name in sorted(imported_modules(path))
        if name == forbidden or name.startswith(forbidden + ".")
    ]


def test_kernels_import_nothing_of_the_service() -> None:
    assert offending("kernels", "squeezeserve.service") == []


@pytest.mark.parametrize("folder", SERVING)
def test_serving_code_does_not_import_the_compressor(folder: str) -> None:
    assert offending(folder, "squeezeserve.service.compress") == []


def test_the_check_sees_function_level_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from squeezeserve.service.compress.formats import x\n")
    assert "squeezeserve.service.compress.formats" in imported_modules(source)
