"""Settings of the target service (``DFLASH_`` environment variables or ``target serve`` flags)."""

from __future__ import annotations

from typing import Annotated

from dfp_shared.config import CommonSettings
from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode


class TargetSettings(CommonSettings):
    model: str = Field(..., min_length=1, description="Target checkpoint: a directory, file:// or s3:// URI.")
    model_id: str = Field("", description="Model id reported to clients (default: the checkpoint's directory name).")
    device: str = Field("auto", description="torch device: auto (CUDA when present), cpu, cuda, cuda:1, ...")
    dtype: str = Field("auto", pattern=r"^(auto|float32|bfloat16|float16)$",
                       description="Model dtype: auto = bf16 on CUDA, fp32 on CPU.")
    layer_ids: Annotated[list[int], NoDecode] = Field(default_factory=list,
                                 description="Decoder layer ids served (comma-separated); empty = every layer.")
    host: str = Field("0.0.0.0", description="gRPC listen address.")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 = any free port).")
    max_batch_tokens: int = Field(8192, ge=1, description="Token budget of one forward pass (rows x longest).")
    max_wait_ms: float = Field(2.0, ge=0, description="Milliseconds a batch waits for more sequences.")
    max_queue_tokens: int = Field(262144, ge=1, description="Tokens allowed to wait; beyond it calls get RESOURCE_EXHAUSTED.")
    max_tokens_per_request: int = Field(65536, ge=1, description="Most tokens one HiddenStates call may carry.")
    chunk_bytes: int = Field(4 << 20, ge=4096, description="Data bytes per reply message (tensor chunk).")
    max_message_bytes: int = Field(64 << 20, ge=1 << 20, description="gRPC send/receive message limit in bytes.")
    handler_threads: int = Field(32, ge=1, description="Threads serving concurrent calls.")
    drain_seconds: float = Field(30.0, ge=0, description="On SIGTERM, seconds to let calls in flight finish.")
    shm_dir: str = Field("/dev/shm", description="Shared-memory directory for same-node clients; empty disables it.")
    shm_sweep_seconds: float = Field(10.0, gt=0, description="Seconds between sweeps for dead clients' segments.")

    @field_validator("layer_ids", mode="before")
    @classmethod
    def _split(cls, value):
        if isinstance(value, str):
            return [int(v) for v in value.replace(" ", "").split(",") if v]
        return value

    @model_validator(mode="after")
    def _check(self):
        if self.chunk_bytes + 4096 > self.max_message_bytes:
            raise ValueError(f"chunk_bytes {self.chunk_bytes} must stay below max_message_bytes "
                             f"{self.max_message_bytes} (minus header room)")
        return self
