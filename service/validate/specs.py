"""How the command line names a model: a local checkpoint directory or ``URL#MODEL`` for an endpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit


class UsageError(Exception):
    """Bad flags, files or endpoints: the command exits 2 with this message."""


@dataclass(frozen=True)
class ModelSpec:
    """One side of the comparison.

    ``path`` is set for a local checkpoint; ``base_url`` (ending in ``/v1``) and ``model`` for an endpoint.
    """

    raw: str
    path: Path | None = None
    base_url: str | None = None
    model: str | None = None

    @property
    def is_local(self) -> bool:
        return self.path is not None

    @property
    def label(self) -> str:
        return str(self.path) if self.path is not None else f"{self.base_url}#{self.model}"


def parse_spec(raw: str, flag: str) -> ModelSpec:
    """``http(s)://host:port[/v1]#model`` -> endpoint; anything else must be a checkpoint directory."""
    if raw.startswith(("http://", "https://")):
        url, sep, model = raw.partition("#")
        if not sep or not model:
            raise UsageError(
                f"{flag} {raw!r}: an endpoint needs the model name after '#', e.g. {url}#my-model"
            )
        parts = urlsplit(url)
        if not parts.hostname:
            raise UsageError(f"{flag} {raw!r}: the URL has no host")
        base = url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        return ModelSpec(raw=raw, base_url=base, model=model)
    path = Path(raw)
    if not (path / "config.json").is_file():
        raise UsageError(
            f"{flag} {raw!r} is neither a checkpoint directory (with config.json) nor an endpoint "
            "(http://host:port/v1#model)"
        )
    return ModelSpec(raw=raw, path=path)


def served_name(spec: ModelSpec, role: str) -> str:
    """The name a worker started for ``spec`` serves it under (distinct per role)."""
    return spec.model or f"validate-{role}"
