"""Spec of a ``pipeline`` job: [generate ->] tokenize -> train, each stage fed by the last one's output.

Without ``generate`` the pipeline starts at ``tokenize``, which then names its own ``input``: a prompt
set whose records already hold the assistant's answers (ShareGPT ``conversations``, ``messages``).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

ANSWERS_INPUT_MISSING = ("required in a pipeline without a generate stage: the prompt set whose records hold "
                         "the answers to train on")


class PipelineSpec(BaseModel):
    """Each stage's spec without the fields the pipeline wires itself (inputs from earlier stages)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    generate: dict | None = Field(default=None, description="GenerateSpec fields; leave out to train on the "
                                  "answers the tokenize stage's input already holds.")
    tokenize: dict = Field(description="TokenizeSpec fields; `input` (the completions) only without generate.")
    train: dict = Field(description="TrainSpec fields except `dataset` (the token shards).")

    STAGES: ClassVar[tuple[str, ...]] = ("generate", "tokenize", "train")

    @model_validator(mode="after")
    def _answers_input(self) -> PipelineSpec:
        if self.generate is None and not self.tokenize.get("input"):
            raise ValueError(f"tokenize.input: {ANSWERS_INPUT_MISSING}")
        return self

    @classmethod
    def stages_of(cls, spec: dict) -> tuple[str, ...]:
        """The stages a pipeline spec (its dict) runs, in order: all of them, or from tokenize without generate."""
        return cls.STAGES if spec.get("generate") is not None else cls.STAGES[1:]
