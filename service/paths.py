"""Where squeezeserve keeps what it makes: ``$SQUEEZESERVE_HOME``, default ``~/.cache/squeezeserve``."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("SQUEEZESERVE_HOME") or Path.home() / ".cache" / "squeezeserve").expanduser()


def keep_compile_cache_in_home() -> None:
    """inductor's cache in ``$SQUEEZESERVE_HOME/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set: beside
    the models, not in /tmp, so a restarted worker (a new container on the same volume) compiles from it in
    tens of seconds instead of minutes (README's CPU section). Here, in a module that imports no torch: the
    first time inductor asks for its cache it sets that variable to its /tmp default, and importing our
    kernels does that, after which the default reads as the user's choice."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(home() / "inductor"))


@contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` to fill; on success it replaces ``out``, on failure it is removed.

    A run that dies half-way therefore never leaves a directory at ``out`` that looks complete.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; checkpoints are meant to be shared (e.g. mounted)
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
