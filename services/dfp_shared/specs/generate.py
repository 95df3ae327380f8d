"""Spec of a ``generate`` job (owned by the generation service)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dfp_shared.specs._common import StorageUri
from dfp_shared.specs._names import endpoint_name, removed_address

OpenAIEndpointName = endpoint_name("OpenAI-compatible endpoint")


# the engine/model rule of _engine_needs, stated in the schema: engine unset or transformers needs a model
_MODEL_NEEDED = {"if": {"properties": {"engine": {"const": "transformers"}}},
                 "then": {"required": ["model"], "properties": {"model": {"type": "string", "minLength": 1}}}}


class GenerateSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra=_MODEL_NEEDED)

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
    seed: int = Field(0, ge=0, lt=1 << 63,
                      description="Base seed (0..2^63-1); each (prompt, sample) derives its own seed from it.")
    thinking: bool = Field(True, description="Generate in the chat template's thinking mode (enable_thinking).")
    samples_per_prompt: int = Field(1, ge=1, le=1024, description="Completions generated per prompt.")

    # work split
    shard_size: int = Field(256, ge=1, le=1_000_000, description="Prompts per shard task (one output JSONL file each).")

    # engine
    engine: Literal["transformers", "openai"] = Field(
        "transformers", description="transformers: model in the worker process; openai: an OpenAI-compatible server.")
    openai_endpoint: OpenAIEndpointName | None = Field(
        None, description="Name of an OpenAI-compatible endpoint the operator configured on the generation workers "
                          "(DFLASH_OPENAI_ENDPOINTS; `default` is DFLASH_OPENAI_BASE_URL); unset: `default`. A name, "
                          "never a URL: the workers' credentials go only to configured endpoints.")
    openai_model: str | None = Field(
        None, min_length=1, max_length=256, description="Model name sent to the OpenAI-compatible server; unset: the worker's DFLASH_OPENAI_MODEL.")
    concurrency: int | None = Field(
        None, ge=1, le=4096, description="Requests in flight per worker (openai engine); unset: sized from the server's "
                                         "KV capacity (vLLM's /metrics: KV tokens / max_new_tokens, 1..64), else 64.")
    request_timeout_s: float = Field(
        600.0, gt=0, le=86400, description="Timeout of one HTTP request, seconds, at most a day (openai engine).")
    max_retries: int = Field(6, ge=0, le=100, description="Retries of a request after 429 / 5xx / timeouts (openai engine).")

    _no_free_url = removed_address("openai_base_url", "openai_endpoint",
                                   "the workers send their credentials only to endpoints the operator configured")

    @model_validator(mode="after")
    def _engine_needs(self) -> GenerateSpec:
        if self.engine == "transformers" and not self.model:
            raise ValueError("model: required when engine is 'transformers' (the target model directory)")
        return self
