"""Spec of a ``generate`` job (owned by the generation service)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ._common import StorageUri


class GenerateSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: StorageUri = Field(description="Prompt set: a JSONL file or a prefix of JSONL files.")
    output: StorageUri | None = Field(
        None, description="Prefix the completion shards are written under; unset: a prefix of the job's own under the storage "
                          "root (<root>/jobs/<job id>/). It must be new or created by the same principal.")
    model: StorageUri | None = Field(
        None, description="Target model directory (local or object storage); required by the transformers engine.")

    # sampling
    temperature: float = Field(0.6, ge=0.0, le=5.0, description="Sampling temperature; 0 = greedy decoding.")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus sampling probability mass.")
    max_new_tokens: int = Field(2048, ge=1, le=1_000_000, description="Most tokens generated per completion (reasoning included).")
    seed: int = Field(0, ge=0, description="Base seed; each (prompt, sample) derives its own seed from it.")
    thinking: bool = Field(True, description="Generate in the chat template's thinking mode (enable_thinking).")
    samples_per_prompt: int = Field(1, ge=1, le=1024, description="Completions generated per prompt.")

    # work split
    shard_size: int = Field(256, ge=1, le=1_000_000, description="Prompts per shard task (one output JSONL file each).")

    # engine
    engine: Literal["transformers", "openai"] = Field(
        "transformers", description="transformers: model in the worker process; openai: an OpenAI-compatible server.")
    openai_base_url: str | None = Field(
        None, description="Base URL of the OpenAI-compatible API (e.g. http://127.0.0.1:8000/v1); "
                          "unset: the worker's DFLASH_OPENAI_BASE_URL.")
    openai_model: str | None = Field(
        None, description="Model name sent to the OpenAI-compatible server; unset: the worker's DFLASH_OPENAI_MODEL.")
    concurrency: int = Field(64, ge=1, le=4096, description="Requests in flight per worker (openai engine).")
    request_timeout_s: float = Field(600.0, gt=0, description="Timeout of one HTTP request, seconds (openai engine).")
    max_retries: int = Field(6, ge=0, le=100, description="Retries of a request after 429 / 5xx / timeouts (openai engine).")

    @model_validator(mode="after")
    def _engine_needs(self) -> GenerateSpec:
        if self.engine == "transformers" and not self.model:
            raise ValueError("model: required when engine is 'transformers' (the target model directory)")
        if self.openai_base_url is not None and not self.openai_base_url.startswith(("http://", "https://")):
            raise ValueError(f"openai_base_url: must start with http:// or https:// (got {self.openai_base_url!r})")
        return self
