"""Spec of a ``generate`` job (owned by the generation service)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ._common import StorageUri


class GenerateSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: StorageUri = Field(description="Prompt set: a JSONL file or a prefix of JSONL files.")
    output: StorageUri = Field(description="Prefix the completion shards are written under.")
    model: StorageUri = Field(description="Target model directory (local or object storage).")
