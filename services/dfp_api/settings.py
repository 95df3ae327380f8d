"""Settings of the api service (env prefix ``DFLASH_``, or the ``api serve`` flags)."""

from __future__ import annotations

from dfp_shared.config import SECRET
from dfp_shared.http_front_door import FrontDoorSettings
from pydantic import Field, ValidationInfo, field_validator


class ApiSettings(FrontDoorSettings):
    """The control plane's HTTP server (its front door's limits: :class:`FrontDoorSettings`), authentication,
    rate limits and event streams."""

    host: str = Field("0.0.0.0", description="Interface the HTTP server binds to.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port (the chart's Service targets 8000).")
    workers: int = Field(1, ge=1, le=64, description="Uvicorn worker processes in this pod.")
    auth_disabled: bool = Field(
        False, description="Accept requests without a key (local demo only; every caller gets all scopes)."
    )
    api_keys: str | None = Field(
        None, json_schema_extra=SECRET,
        description='API keys: a JSON/YAML list of {"name", "sha256", "scopes": ["read","write","admin"], '
        '"expires_at"?}, or the path of a file holding it (a mounted Secret; re-read when it changes).',
    )
    rate_limit_per_s: float = Field(
        50.0, ge=0, description="Requests per second each API key may make on average; 0 turns rate limits off."
    )
    rate_limit_burst: int = Field(200, ge=1, description="Requests a key may make at once before the rate applies.")
    max_streams_per_key: int = Field(
        8, ge=0, description="Event streams (GET /v1/jobs/{id}/events) one API key may hold open at once, across "
        "replicas; 0 = no limit. One more is a 429.")
    max_event_streams: int = Field(
        512, ge=1, le=100_000, description="Event streams this server process holds open at once, every key "
        "together; they use a Redis connection pool of their own, of this size, apart from the request path's.")
    max_active_jobs_per_key: int = Field(
        50, ge=0, description="Queued plus running jobs one API key may have; 0 = no limit. One more submit is a 429.")
    redis_max_connections: int = Field(
        256, ge=4, le=100_000, description="Redis connections of the request path (reads, rate limits), per process.")
    api_docs: bool = Field(
        False, description="Serve /docs and /redoc (their pages load scripts from a CDN; /openapi.json is always "
        "served).")
    sse_poll_s: float = Field(
        1.0, gt=0, le=60, description="Seconds an event stream waits on Redis before checking progress again."
    )
    sse_max_s: float = Field(
        3600.0, gt=0, description="Seconds after which an event stream closes (clients resume with Last-Event-ID)."
    )
    max_page_size: int = Field(500, ge=1, le=10_000, description="Largest page GET /v1/jobs returns.")
    max_body_bytes: int = Field(
        1024 * 1024, ge=1024, le=1024 ** 3,
        description="Largest request body accepted, in bytes; a larger one is a 413 before it is read.")
    access_log: bool = Field(False, description="Log every HTTP request (uvicorn access log).")

    @field_validator("api_keys")
    @classmethod
    def _keys_or_open(cls, value: str | None, info: ValidationInfo) -> str | None:
        if not value:
            if info.data.get("auth_disabled"):
                return None
            raise ValueError("no API keys configured: give a JSON list of keys or a file path "
                             "(or set DFLASH_AUTH_DISABLED=true for a local demo)")
        from .auth import parse_keys

        parse_keys(value)
        return value
