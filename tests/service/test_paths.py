"""``atomic_directory``: a finished write replaces the target; a failed one leaves no trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from squeezeserve.service.paths import atomic_directory


def test_success_replaces_the_target(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with atomic_directory(out) as tmp:
        (tmp / "new.txt").write_text("new")
        assert not (out / "new.txt").exists()  # nothing visible until the end
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_failure_leaves_the_target_and_no_temporary(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_directory(out) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
