"""Spec of a ``tokenize`` job (owned by the tokenizer service).

Masking semantics: the loss mask covers what the assistant generated after the template's
generation prompt (``add_generation_prompt=True``): its reasoning block (``<think>...</think>``
where the template renders one), its content, any tool calls, and the end-of-turn token that
stops it. System, user and tool turns and the template's role headers are never trained.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dfp_shared.specs._common import FiniteJson, StorageUri


class TokenizeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    input: StorageUri = Field(description="Prefix of completion JSONL files (.jsonl or .jsonl.gz), or one such file.")
    output: StorageUri | None = Field(
        None, description="Dataset prefix: shards, manifest, stats and errors go here; unset: a prefix of the job's own under the storage "
                          "root (<root>/jobs/<job id>/). It must be new or created by the same principal.")
    tokenizer: StorageUri = Field(description="Hugging Face tokenizer directory (local or object storage).")
    thinking: bool = Field(
        True, description="Render in thinking mode (enable_thinking=true); false drops reasoning from assistant turns "
                          "and uses the template's non-thinking generation prompt.")
    train_reasoning: bool = Field(
        True, description="Train the reasoning block of assistant turns; false trains only content and end-of-turn.")
    train_turns: Literal["all", "last"] = Field(
        "all", description="Train every assistant turn, or only the last one of each conversation.")
    max_length: int | None = Field(
        None, ge=8, le=1 << 20,
        description="Longest sample in tokens (after the chat template), 8..2^20; None = no limit.")
    truncation: Literal["drop", "truncate"] = Field(
        "drop", description="Sample over max_length: drop it (reported as too_long in the errors file) or keep its "
                            "first max_length tokens (dropped if no trained token is left).")
    chat_template: str | None = Field(
        None, max_length=262_144,
        description="Chat template that replaces the tokenizer's own (None = the tokenizer's): the name of a template "
                    "the operator registered (DFLASH_CHAT_TEMPLATES_DIR/<name>.jinja), or Jinja text where the "
                    "deployment accepts it. Every template renders under the operator's time and memory budget "
                    "per record.")
    template_kwargs: FiniteJson = Field(
        default_factory=dict, max_length=64,
        description="Extra variables passed to the chat template (enable_thinking is set from `thinking`).")
    duplicate_ids: Literal["keep", "drop"] = Field(
        "keep", description="A line whose sample id an earlier line of the same file has: keep it (reported in the "
                            "errors file with kept=true and counted in stats as duplicate_ids) or drop it (a bad line, "
                            "duplicate_id).")
    samples_per_batch: int = Field(256, ge=1, le=65536, description="Samples tokenized per encode_batch call.")

    @model_validator(mode="after")
    def _check(self) -> TokenizeSpec:
        if "enable_thinking" in self.template_kwargs:
            raise ValueError("set thinking mode with `thinking`, not template_kwargs.enable_thinking")
        return self
