"""Spec of a ``pipeline`` job: generate -> tokenize -> train, each stage fed by the last one's output."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field


class PipelineSpec(BaseModel):
    """Each stage's spec without the fields the pipeline wires itself (inputs from earlier stages)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    generate: dict = Field(description="GenerateSpec fields.")
    tokenize: dict = Field(description="TokenizeSpec fields except `input` (the completions).")
    train: dict = Field(description="TrainSpec fields except `dataset` (the token shards).")

    STAGES: ClassVar[tuple[str, ...]] = ("generate", "tokenize", "train")
