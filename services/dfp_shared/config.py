"""Typed settings: one env-var prefix (``DFLASH_``) or a CLI flag for every setting but the secrets.

Each service defines a ``BaseSettings`` subclass built on :class:`CommonSettings`; its entry
point calls :func:`load_settings` with the CLI flags that were given, which override the
environment. An invalid value raises :class:`ConfigError` naming the variable and the reason.
A secret (:func:`is_secret`) comes from the environment only.
"""

from __future__ import annotations

from typing import TypeVar, get_args

from pydantic import Field, SecretBytes, SecretStr, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "DFLASH_"


SECRET = {"secret": True}
"""``json_schema_extra`` of a settings field holding credentials: environment only, never a CLI flag."""


class ConfigError(ValueError):
    """A setting is missing or invalid; the message names the environment variable."""


def is_secret(field: FieldInfo) -> bool:
    """Whether a settings field holds credentials (a ``SecretStr``, or marked :data:`SECRET`)."""
    extra = field.json_schema_extra
    if isinstance(extra, dict) and extra.get("secret"):
        return True
    return any(t in (SecretStr, SecretBytes) for t in (field.annotation, *get_args(field.annotation)))


class CommonSettings(BaseSettings):
    """Settings every long-running service shares."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", validate_default=True)

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL for task streams and job records.")
    storage_url: str = Field(
        "file://./dflash-data", description="Root of object storage: file:///dir or s3://bucket/prefix."
    )
    allowed_prefixes: str = Field(
        "", description="More storage prefixes jobs may read and write besides storage_url, comma-separated "
                        "(file:///dir, s3://bucket/prefix); every URI in a job spec must lie inside one of them.")
    reserved_prefixes: str = Field(
        "", description="Storage prefixes kept for one principal's jobs, a JSON object of prefix -> API key name "
                        "(\"\": no job's): no other principal's job may read or write inside one "
                        "(e.g. {\"s3://bucket/served\": \"adapt\", \"s3://bucket/capture\": \"\"}).")
    s3_endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint URL (MinIO, moto, ...); unset means AWS."
    )
    s3_region: str = Field("us-east-1", description="S3 region name.")
    log_level: str = Field("INFO", pattern=r"^(DEBUG|INFO|WARNING|ERROR)$", description="Log level: DEBUG, INFO, WARNING or ERROR.")
    log_json: bool = Field(True, description="Structured JSON logs (false: human-readable lines).")
    metrics_port: int = Field(0, ge=0, le=65535, description="Port of the Prometheus /metrics endpoint; 0 disables it.")

    @field_validator("reserved_prefixes")
    @classmethod
    def _reservations(cls, value: str) -> str:
        from dfp_shared.storage.roots import parse_reservations

        parse_reservations(value)
        return value


S = TypeVar("S", bound=BaseSettings)


def env_name(settings_cls: type[BaseSettings], field: str) -> str:
    prefix = settings_cls.model_config.get("env_prefix", "") or ""
    return f"{prefix}{field}".upper()


def load_settings(settings_cls: type[S], **overrides) -> S:
    """Build settings from the environment, with non-None ``overrides`` (CLI flags) on top.

    Raises :class:`ConfigError` whose message lists each bad variable and the reason.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return settings_cls(**given)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else "?"
            info = settings_cls.model_fields.get(field)
            secret = info is not None and is_secret(info)
            source = f"--{field.replace('_', '-')}" if field in given and not secret else env_name(settings_cls, field)
            got = "" if secret else f" (got {err.get('input')!r})"  # a secret's value is never echoed
            problems.append(f"{source}: {err['msg']}{got}")
        raise ConfigError("invalid configuration: " + "; ".join(problems)) from None
