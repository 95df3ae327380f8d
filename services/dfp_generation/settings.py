"""Settings of the generation worker (env prefix ``DFLASH_``, or the matching CLI flag)."""

from __future__ import annotations

from dfp_shared.config import CommonSettings
from pydantic import Field, SecretStr


class GenerationSettings(CommonSettings):
    device: str = Field("auto", description="Torch device of the transformers engine: auto (CUDA if present), cpu, cuda:N.")
    dtype: str = Field("auto", pattern=r"^(auto|float32|bfloat16|float16)$",
                       description="Model dtype of the transformers engine; auto = bf16 on CUDA, fp32 on CPU.")
    generation_batch_size: int = Field(
        8, ge=1, le=4096, description="Prompts per generate() call of the transformers engine.")
    openai_base_url: str | None = Field(
        None, description="Default OpenAI-compatible base URL (e.g. a vLLM sidecar, http://127.0.0.1:8000/v1).")
    openai_model: str | None = Field(None, description="Default model name sent to the OpenAI-compatible server.")
    openai_api_key: SecretStr | None = Field(None, description="Bearer token for the OpenAI-compatible server.")
    backoff_base_s: float = Field(0.5, gt=0, description="First retry delay of the openai engine, seconds (doubles per retry).")
    backoff_max_s: float = Field(30.0, gt=0, description="Largest retry delay of the openai engine, seconds.")
    lease_ms: int = Field(120_000, ge=1000, description="Task lease, ms: a task idle this long is reclaimed by another worker.")
    max_deliveries: int = Field(3, ge=1, description="Deliveries of a task before it is dead-lettered (and its job failed).")
    checkpoint_interval_s: float = Field(
        30.0, ge=0, description="Seconds between partial-shard checkpoints (resume after a crash); 0 = after every result.")
    progress_interval_s: float = Field(
        1.0, ge=0, description="Seconds between updates of a running shard's progress in the job record; 0 = every result.")
