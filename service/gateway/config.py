"""The gateway's one settings model.

Sources, highest first: keyword arguments (the CLI maps its flags onto them), a YAML file given with
``--config`` (same keys as the fields), environment variables ``SQUEEZESERVE_GATEWAY_<FIELD>``, defaults.
List fields read from the environment accept a JSON list or comma-separated values, e.g.
``SQUEEZESERVE_GATEWAY_UPSTREAMS=http://w1:8001,http://w2:8001``.

Nothing is built at import time: ``get_settings()`` reads the environment once, on first use; the app
factory pins the settings it was given (``app.state.settings``, which routes depend on), and tests hand
their own to the factory.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from squeezeserve.service.secrets import read_api_keys
from squeezeserve.service.serving import DEFAULT_GRACE_SECONDS

# The values are the CLI choices and the routing factory's keys.
RoutingName = Literal["least_outstanding", "round_robin", "prefix_affinity"]
ENV_PREFIX = "SQUEEZESERVE_GATEWAY_"


def _split_list(value: Any) -> Any:
    """Accept a JSON list or comma-separated string for list fields (env vars, YAML scalars)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        return json.loads(text)
    return [part.strip() for part in text.split(",") if part.strip()]


DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


class ApiKey(BaseModel):
    """One key clients may send, and its own limits (None: the gateway-wide default, if any)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(repr=False)
    requests_per_minute: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None


class GatewaySettings(BaseSettings):
    """Everything the gateway can be told. Bad values fail at startup with one sentence naming the field."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    upstreams: Annotated[list[str], NoDecode] = Field(
        min_length=1,
        description="base URLs of OpenAI-compatible workers, e.g. http://127.0.0.1:8001; "
        "dns+http://NAME:PORT stands for every address NAME resolves to (a headless Service's Pods)",
    )
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    routing: RoutingName = "least_outstanding"
    # prefix_affinity: how much of the prompt is the key, and how far above the mean load one upstream may go
    affinity_prefix_chars: Annotated[int, Field(ge=1)] = 256
    affinity_load_factor: Annotated[float, Field(gt=0)] = 0.25
    # repr=False: keys never show up in logs or tracebacks that print the settings. Each entry is a key, or
    # a mapping {key, requests_per_minute, tokens_per_minute} for a key with limits of its own.
    api_keys: Annotated[list[ApiKey], NoDecode] = Field(default_factory=list, repr=False)
    # Limits for every key that sets none of its own (per key, per gateway process: see ratelimit.py).
    requests_per_minute: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None
    # Keys in a file (comma-, space- or newline-separated; added to api_keys), e.g. a compose or Kubernetes
    # secret mounted read-only: the keys stay out of the environment, which `docker inspect` shows to anyone
    # who may talk to the Docker daemon. An empty file (or /dev/null) adds none.
    api_keys_file: Path | None = None
    upstream_api_key: str | None = Field(default=None, repr=False, description="sent upstream as Bearer")
    request_timeout: Annotated[float, Field(gt=0)] = 600.0
    connect_timeout: Annotated[float, Field(gt=0)] = 5.0
    health_interval: Annotated[float, Field(gt=0)] = 5.0
    health_timeout: Annotated[float, Field(gt=0)] = 2.0
    unhealthy_threshold: Annotated[int, Field(ge=1)] = 3
    max_inflight_per_upstream: Annotated[int, Field(ge=1)] = 64
    max_body_bytes: Annotated[int, Field(ge=1)] = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    retry_after_seconds: Annotated[int, Field(ge=1)] = 1
    grace_seconds: Annotated[float, Field(ge=0)] = DEFAULT_GRACE_SECONDS  # drain on SIGTERM / Ctrl-C
    # Processes sharing the port; more than one serves metrics in Prometheus multiprocess mode.
    workers: Annotated[int, Field(ge=1)] = 1

    @property
    def has_rate_limits(self) -> bool:
        """Whether any key has a request or token limit (its own or the default)."""
        defaults = self.requests_per_minute or self.tokens_per_minute
        return bool(self.api_keys) and bool(
            defaults or any(e.requests_per_minute or e.tokens_per_minute for e in self.api_keys)
        )

    @field_validator("upstreams", mode="before")
    @classmethod
    def _parse_list(cls, value: Any) -> Any:
        return _split_list(value)

    @field_validator("upstreams")
    @classmethod
    def _check_urls(cls, urls: list[str]) -> list[str]:
        cleaned = []
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https", "dns+http", "dns+https") or not parts.netloc:
                raise ValueError(
                    f"upstream {url!r} is not an http(s) URL such as http://127.0.0.1:8001 "
                    "(or dns+http://NAME:PORT: every address NAME resolves to)"
                )
            cleaned.append(url.rstrip("/"))
        if len(set(cleaned)) != len(cleaned):
            raise ValueError("each upstream may be listed only once")
        return cleaned

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys_as_entries(cls, values: Any) -> Any:
        values = _split_list(values)
        if not isinstance(values, list):
            return values
        entries = [{"key": value} if isinstance(value, str) else value for value in values]
        if any(isinstance(entry, dict) and not entry.get("key") for entry in entries):
            raise ValueError("API keys must not be empty strings")
        return entries

    @field_validator("api_keys")
    @classmethod
    def _check_keys(cls, keys: list[ApiKey]) -> list[ApiKey]:
        if len({entry.key for entry in keys}) != len(keys):
            raise ValueError("each API key may be listed only once")
        return keys

    @model_validator(mode="after")
    def _add_keys_from_file(self) -> GatewaySettings:
        if self.api_keys_file is None:
            return self
        try:
            from_file = read_api_keys(self.api_keys_file)
        except ValueError as exc:
            raise ValueError(f"api_keys_file: {exc}") from exc
        known = {entry.key for entry in self.api_keys}
        self.api_keys = [
            *self.api_keys,
            *(ApiKey(key=key) for key in dict.fromkeys(from_file) if key not in known),
        ]
        return self

    @model_validator(mode="after")
    def _limits_need_keys(self) -> GatewaySettings:
        if (self.requests_per_minute or self.tokens_per_minute) and not self.api_keys:
            raise ValueError("requests_per_minute and tokens_per_minute are limits per API key: set api_keys")
        return self


class SettingsError(ValueError):
    """Settings could not be built; the message is one sentence per problem, fit for a terminal."""


def describe_validation_error(exc: ValidationError) -> str:
    """One line per invalid field: ``field: what is wrong``."""
    lines = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error.get("loc", ())) or "settings"
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        lines.append(f"{field}: {message}")
    return "; ".join(lines)


def load_yaml(path: Path) -> dict[str, Any]:
    """Read a YAML settings file: a mapping with the field names as keys (dashes allowed)."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise SettingsError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a mapping of setting names to values")
    return {str(key).replace("-", "_"): value for key, value in data.items()}


def build_settings(config_file: Path | None = None, **overrides: Any) -> GatewaySettings:
    """Merge defaults < environment < YAML file < ``overrides`` (``None`` overrides are ignored)."""
    values = load_yaml(config_file) if config_file is not None else {}
    values.update({key: value for key, value in overrides.items() if value is not None})
    try:
        return GatewaySettings(**values)
    except ValidationError as exc:
        raise SettingsError(describe_validation_error(exc)) from exc


@lru_cache
def get_settings() -> GatewaySettings:
    """The settings from the environment, built once: what ``create_app()`` serves when given none."""
    return build_settings()
