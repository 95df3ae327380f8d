"""Spec of an ``evaluate`` job (owned by the trainer service, whose workers run it).

An exported drafter is measured by real greedy speculative decoding against its target on the
user's prompt sets, beside n-gram (prompt-lookup) speculation at the same draft length.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dfp_shared.specs._common import StorageUri

MAX_PROMPT_SETS = 16
MAX_PROMPTS_PER_SET = 10_000
MAX_NEW_TOKENS = 8192
MAX_PROMPT_TOKENS = 1 << 16
MAX_NGRAM = 64
MAX_BATCH = 64


class EvaluateSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    drafter: StorageUri = Field(description="Exported drafter directory (config.json + model.safetensors, as a train "
                                            "job's `drafter/` output).")
    target: StorageUri = Field(description="Target model directory (local or object storage) the drafter was trained for.")
    prompts: list[StorageUri] = Field(
        min_length=1, max_length=MAX_PROMPT_SETS,
        description=f"Prompt sets (1..{MAX_PROMPT_SETS}): each a JSONL file or a prefix of JSONL files, one record a "
                    "line with `prompt` or `messages` (as a generate job's prompts).")
    output: StorageUri | None = Field(
        None, description="Prefix the report (`evaluation.json`) is written under; unset: a prefix of the job's own "
                          "under the storage root (<root>/jobs/<job id>/). It must be new or created by the same principal.")
    max_prompts: int = Field(64, ge=1, le=MAX_PROMPTS_PER_SET,
                             description=f"Prompts evaluated per set, the first ones read (1..{MAX_PROMPTS_PER_SET}).")
    max_new_tokens: int = Field(256, ge=1, le=MAX_NEW_TOKENS,
                                description=f"Tokens generated per prompt (1..{MAX_NEW_TOKENS}).")
    max_prompt_tokens: int = Field(
        4096, ge=1, le=MAX_PROMPT_TOKENS,
        description="Prompts longer than this many tokens after the chat template are skipped and counted (1..2^16).")
    enable_thinking: bool = Field(True, description="Thinking mode the prompts are rendered in: the mode the drafter serves in.")
    ngram_max: int = Field(4, ge=1, le=MAX_NGRAM, description=f"Longest n-gram the baseline matches (vLLM's "
                                                              f"prompt_lookup_max), 1..{MAX_NGRAM}.")
    include_outputs: bool = Field(False, description="Also write each prompt's generated token ids (DFlash and n-gram) "
                                                     "into the report.")
    batch_size: int = Field(8, ge=1, le=MAX_BATCH,
                            description=f"Prompts decoded at once (1..{MAX_BATCH}); outputs and counts equal decoding one "
                                        "at a time, larger batches decode more tokens per second and hold more memory.")
    ngram_min: int = Field(1, ge=1, le=MAX_NGRAM, description=f"Shortest n-gram the baseline matches (vLLM's "
                                                              f"prompt_lookup_min), 1..{MAX_NGRAM}.")
    dflash_method: Literal["decode", "replay"] = Field(
        "decode", description="How the drafter's steps are counted: `decode`, by real greedy speculative decoding; "
                              "`replay`, from the target's greedy output (which n-gram speculation's decoding emits) "
                              "in one target and one drafter forward per prompt: the same steps save a draft whose "
                              "two best tokens tie within float noise, at a fraction of the cost.")

    @model_validator(mode="after")
    def _ngram_range(self) -> EvaluateSpec:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) is above ngram_max ({self.ngram_max})")
        return self
