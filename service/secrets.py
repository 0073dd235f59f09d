"""API keys from a file: a compose or Kubernetes secret mounted read-only.

Keys kept in a file stay out of the process environment, which ``docker inspect`` shows to anyone who may
talk to the Docker daemon. The gateway accepts every key in its file; the validation job sends the first.
No torch here: the gateway imports this module.
"""

from __future__ import annotations

import re
from pathlib import Path

SEPARATORS = re.compile(r"[\s,]+")


def read_api_keys(path: Path) -> list[str]:
    """The keys in ``path``: comma-, space- or newline-separated, in order, without repeats. An empty file
    (or ``/dev/null``) holds none. Raises ``ValueError`` with one sentence when the file cannot be read."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read API keys file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"cannot read API keys file {path}: not UTF-8 text") from exc
    return list(dict.fromkeys(key for key in SEPARATORS.split(text) if key))
