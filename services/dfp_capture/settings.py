"""Settings of the capture pass-through (``DFLASH_CAPTURE_*``, or the matching ``--capture-*`` flag)."""

from __future__ import annotations

import json
import re

from dfp_shared.http_front_door import FrontDoorSettings
from pydantic import Field, field_validator

MAX_PATTERNS = 64
MAX_PATTERN_CHARS = 512
CAPTURE_HEADER = "X-DFlash-Capture"


def parse_patterns(value: str) -> list[str]:
    """``DFLASH_CAPTURE_REDACT``: a JSON list of regular expressions (or one per line), bounded in count and length."""
    text = value.strip()
    if not text:
        return []
    if text.startswith("["):
        patterns = json.loads(text)
        if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
            raise ValueError("expected a JSON list of strings")
    else:
        patterns = [line for line in text.splitlines() if line.strip()]
    if len(patterns) > MAX_PATTERNS:
        raise ValueError(f"{len(patterns)} patterns; at most {MAX_PATTERNS}")
    for pattern in patterns:
        if len(pattern) > MAX_PATTERN_CHARS:
            raise ValueError(f"a pattern of {len(pattern)} characters; at most {MAX_PATTERN_CHARS}")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{pattern!r}: {exc}") from None
    return patterns


class CaptureSettings(FrontDoorSettings):
    """The pass-through's settings; its front door's limits (``DFLASH_MAX_HEADER_BYTES``, ``DFLASH_MAX_HEADERS``,
    ``DFLASH_HEAD_TIMEOUT_S``, ``DFLASH_KEEP_ALIVE_TIMEOUT_S``, ``DFLASH_MAX_CONNECTIONS``) are the API's."""

    capture_upstream: str = Field(
        "http://127.0.0.1:8000", pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$",
        description="Base URL of the serving engine (vLLM, SGLang) the pass-through forwards to, without /v1.")
    capture_host: str = Field("0.0.0.0", description="Address the pass-through listens on.")
    capture_port: int = Field(8100, ge=0, le=65535, description="Port the pass-through listens on.")
    capture_enabled: bool = Field(
        False, description="Capture every request (still subject to the sampling rate and the opt-out header); "
                           "off: only requests that opt in with the capture header are captured.")
    capture_header: str = Field(
        CAPTURE_HEADER, pattern=r"^[A-Za-z0-9-]{1,64}$",
        description="Request header that opts a request in (1) or out (0) of capture; it is not forwarded.")
    capture_sample_rate: float = Field(1.0, ge=0.0, le=1.0,
                                       description="Share of opted-in requests that are captured (0..1).")
    capture_prefix: str = Field(
        "", description="Storage prefix of the captured shards (file:// or s3://, inside the storage roots); "
                        "empty: <storage_url>/capture.")
    capture_redact: str = Field(
        "", description=f"Regular expressions (a JSON list, or one per line; at most {MAX_PATTERNS} of at most "
                        f"{MAX_PATTERN_CHARS} characters) whose matches in every captured string are replaced "
                        "by [REDACTED] before anything is written.")
    capture_retention_hours: float = Field(168.0, gt=0, description="Shards older than this many hours are deleted.")
    capture_sweep_interval_s: float = Field(600.0, gt=0, description="Seconds between retention sweeps.")
    capture_flush_interval_s: float = Field(10.0, gt=0, description="Seconds between shard writes (one shard a flush).")
    capture_queue_records: int = Field(10_000, ge=1, description="Most captured requests waiting to be written.")
    capture_queue_bytes: int = Field(256 * 2**20, ge=1024, description="Most bytes of captures waiting to be written.")
    capture_max_body_bytes: int = Field(
        16 * 2**20, ge=1024, description="Largest request body the pass-through accepts (larger: 413).")
    capture_max_messages: int = Field(512, ge=1, description="Requests with more messages are forwarded, not captured.")
    capture_max_record_bytes: int = Field(
        4 * 2**20, ge=1024, description="Largest record written; a larger capture is dropped (counted).")
    capture_max_choices: int = Field(16, ge=1, le=1024, description="Most choices (n) of one request captured.")
    capture_worker: str = Field(
        "", pattern=r"^[A-Za-z0-9_.-]{0,64}$",
        description="Name of this replica in shard names; empty: the host name.")
    capture_connect_timeout_s: float = Field(10.0, gt=0, description="Seconds to connect to the upstream.")
    capture_read_timeout_s: float = Field(600.0, gt=0, description="Seconds the upstream may go silent mid-reply.")
    capture_send_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="Seconds a client may leave a piece of its reply unread (the kernel's "
        "buffers full); then its connection is cut, so a client that stops reading holds no upstream connection.")
    capture_max_connections: int = Field(512, ge=1, description="Most connections to the upstream at once.")

    @field_validator("capture_redact")
    @classmethod
    def _patterns(cls, value: str) -> str:
        parse_patterns(value)
        return value

    @field_validator("capture_upstream")
    @classmethod
    def _upstream(cls, value: str) -> str:
        return value.rstrip("/")

    def redact_patterns(self) -> list[str]:
        return parse_patterns(self.capture_redact)

    def prefix(self) -> str:
        return self.capture_prefix or self.storage_url.rstrip("/") + "/capture"
