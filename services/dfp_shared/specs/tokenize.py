"""Spec of a ``tokenize`` job (owned by the tokenizer service)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ._common import StorageUri


class TokenizeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: StorageUri = Field(description="Prefix of completion JSONL files.")
    output: StorageUri = Field(description="Dataset prefix: shards, manifest, stats and errors go here.")
    tokenizer: StorageUri = Field(description="Hugging Face tokenizer directory (local or object storage).")
