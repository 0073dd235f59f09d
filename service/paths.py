"""Where squeezeserve keeps what it makes: ``$SQUEEZESERVE_HOME``, default ``~/.cache/squeezeserve``."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("SQUEEZESERVE_HOME") or Path.home() / ".cache" / "squeezeserve").expanduser()
