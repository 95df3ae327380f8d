"""Settings of the tokenizer worker pool (env prefix ``DFLASH_``, or the matching CLI flag)."""

from __future__ import annotations

import os

from dfp_shared.config import CommonSettings
from pydantic import Field, field_validator

from .limits import DEFAULT_MAX_LINE_BYTES


class TokenizerSettings(CommonSettings):
    processes: str = Field("auto", description="Worker processes in this pod: 'auto' = one per CPU core, or a number.")
    threads: int = Field(2, ge=1, le=16, description="Task threads per process: downloads/uploads of one task overlap "
                                                     "the tokenization of another.")
    lease_ms: int = Field(60_000, ge=500, description="Task lease, ms: a task idle this long is reclaimed by another worker.")
    max_deliveries: int = Field(3, ge=1, description="Deliveries of a task before it is dead-lettered (and its job failed).")
    cache_dir: str | None = Field(None, description="Cache root; tokenizers fetched from object storage go to <cache_dir>/tokenizers "
                                                    "(default ~/.cache/dflash-pipeline).")
    restart_delay_s: float = Field(1.0, ge=0, description="Seconds before a worker process that died is started again.")
    max_line_bytes: int = Field(DEFAULT_MAX_LINE_BYTES, ge=1024, le=1 << 30,
                                description="Longest input line in bytes; a longer one is a bad line (line_too_long), "
                                            "rejected before it is parsed or tokenized.")
    template_timeout_s: float = Field(2.0, gt=0, le=3600, description="Time budget of one record's chat-template "
                                                                       "rendering (over it: template_budget).")
    template_memory_mb: int = Field(512, ge=16, le=1 << 20, description="Memory a chat-template rendering may add "
                                                                         "to the process, MiB.")
    chat_templates_dir: str | None = Field(None, description="Directory of operator-registered chat templates "
                                                             "(<name>.jinja); a spec's chat_template may name one.")
    allow_inline_templates: bool = Field(True, description="Accept a spec's chat_template given as Jinja text "
                                                           "(rendered under the budget); false: registered names only.")

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
