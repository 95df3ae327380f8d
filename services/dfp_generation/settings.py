"""Settings of the generation worker (env prefix ``DFLASH_``, or the matching CLI flag)."""

from __future__ import annotations

from dfp_shared.config import CommonSettings
from pydantic import Field, SecretStr, ValidationInfo, field_validator

from . import endpoints


class GenerationSettings(CommonSettings):
    device: str = Field("auto", description="Torch device of the transformers engine: auto (CUDA if present), cpu, cuda:N.")
    dtype: str = Field("auto", pattern=r"^(auto|float32|bfloat16|float16)$",
                       description="Model dtype of the transformers engine; auto = bf16 on CUDA, fp32 on CPU.")
    generation_batch_size: int = Field(
        8, ge=1, le=4096, description="Prompts per generate() call of the transformers engine.")
    openai_base_url: str | None = Field(
        None, description="Base URL of the OpenAI-compatible endpoint named `default` (e.g. a vLLM sidecar, "
                          "http://127.0.0.1:8000/v1).")
    openai_model: str | None = Field(None, description="Model name sent to the `default` endpoint when a job names none.")
    openai_api_key: SecretStr | None = Field(
        None, description="Bearer token of the `default` endpoint; never sent to any other address.")
    openai_endpoints: str = Field(
        "", description="Further named OpenAI-compatible endpoints jobs may choose (spec `openai_endpoint`), as a JSON "
                        "object name -> URL or name -> {url, model, api_key_env, api_key_file}; the token of each "
                        "comes from that environment variable or file (a mounted Secret).")
    backoff_base_s: float = Field(0.5, gt=0, description="First retry delay of the openai engine, seconds (doubles per retry).")
    backoff_max_s: float = Field(30.0, gt=0, description="Largest retry delay of the openai engine, seconds.")
    lease_ms: int = Field(120_000, ge=1000, description="Task lease, ms: a task idle this long is reclaimed by another worker.")
    max_deliveries: int = Field(3, ge=1, description="Deliveries of a task before it is dead-lettered (and its job failed).")
    checkpoint_interval_s: float = Field(
        30.0, ge=0, description="Seconds between partial-shard checkpoints (resume after a crash); 0 = after every result.")
    progress_interval_s: float = Field(
        1.0, ge=0, description="Seconds between updates of a running shard's progress in the job record; 0 = every result.")

    @field_validator("openai_base_url")
    @classmethod
    def _base_url(cls, value: str | None) -> str | None:
        return endpoints.check_url(value) if value else value

    @field_validator("openai_endpoints")
    @classmethod
    def _endpoints(cls, value: str, info: ValidationInfo) -> str:
        named = endpoints.parse_endpoints(value)
        if endpoints.DEFAULT in named and info.data.get("openai_base_url"):
            raise ValueError(f"names {endpoints.DEFAULT!r}, which DFLASH_OPENAI_BASE_URL already is; set one of the two")
        return value

    def openai_endpoint_map(self) -> dict[str, endpoints.Endpoint]:
        """Every endpoint a job may name: ``default`` (DFLASH_OPENAI_BASE_URL) and DFLASH_OPENAI_ENDPOINTS."""
        key = self.openai_api_key.get_secret_value() if self.openai_api_key else None
        return endpoints.configured(self.openai_base_url, key, self.openai_model, self.openai_endpoints)
