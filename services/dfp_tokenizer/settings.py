"""Settings of the tokenizer worker pool (env prefix ``DFLASH_``, or the matching CLI flag)."""

from __future__ import annotations

import os

from dfp_shared.config import CommonSettings
from pydantic import Field, field_validator


class TokenizerSettings(CommonSettings):
    processes: str = Field("auto", description="Worker processes in this pod: 'auto' = one per CPU core, or a number.")
    threads: int = Field(2, ge=1, le=16, description="Task threads per process: downloads/uploads of one task overlap "
                                                     "the tokenization of another.")
    lease_ms: int = Field(60_000, ge=500, description="Task lease, ms: a task idle this long is reclaimed by another worker.")
    max_deliveries: int = Field(3, ge=1, description="Deliveries of a task before it is dead-lettered (and its job failed).")
    cache_dir: str | None = Field(None, description="Cache root; tokenizers fetched from object storage go to <cache_dir>/tokenizers "
                                                    "(default ~/.cache/dflash-pipeline).")
    restart_delay_s: float = Field(1.0, ge=0, description="Seconds before a worker process that died is started again.")

    @field_validator("processes")
    @classmethod
    def _processes(cls, value: str) -> str:
        if value != "auto" and not (value.isdigit() and int(value) >= 1):
            raise ValueError("must be 'auto' or a positive integer")
        return value

    def process_count(self) -> int:
        if self.processes == "auto":
            try:
                return max(1, len(os.sched_getaffinity(0)))
            except AttributeError:  # pragma: no cover - not Linux
                return max(1, os.cpu_count() or 1)
        return int(self.processes)
