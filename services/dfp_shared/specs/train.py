"""Spec of a ``train`` job (owned by the trainer service)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from ._common import StorageUri


class TrainSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset: StorageUri = Field(description="Tokenized dataset prefix (with its manifest).")
    target: StorageUri = Field(description="Target model directory (local or object storage).")
    output: StorageUri = Field(description="Prefix for checkpoints, the drafter export and the eval report.")
