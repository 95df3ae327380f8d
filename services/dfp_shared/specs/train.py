"""Spec of a ``train`` job (owned by the trainer service)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..tokenizer_assets import MASK_TOKEN
from ._common import StorageUri
from ._names import endpoint_name, refuse_removed

LayerType = Literal["full_attention", "sliding_attention"]
TargetEndpointName = endpoint_name("hidden-state target")
LayerId = Annotated[int, Field(ge=0, le=1023)]

# Bounds: far beyond any real run, near enough that no value can make a worker allocate, loop or
# overflow without end. MAX_STEPS keeps checkpoint directories at eight digits (step-NNNNNNNN).
MAX_STEPS = 99_999_999
MAX_LAYERS = 64
MAX_SEQ_TOKENS = 1 << 20


class TrainSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    dataset: StorageUri = Field(description="Tokenized dataset prefix (with its manifest).")
    target: StorageUri = Field(description="Target model directory (local or object storage).")
    output: StorageUri | None = Field(
        None, description="Prefix for checkpoints, the drafter export and the eval report; unset: a prefix of the job's own under the storage "
                          "root (<root>/jobs/<job id>/). It must be new or created by the same principal.")

    steps: int | None = Field(None, ge=1, le=MAX_STEPS,
                              description="Optimiser steps to train (1..99999999); unset: `epochs` passes over the data.")
    epochs: float = Field(3.0, gt=0, le=1000, description="Passes over the dataset when `steps` is unset (at most 1000).")
    tokens_per_batch: int = Field(16384, ge=16, le=1 << 24,
                                  description="Padded tokens per optimiser step, all ranks together (16..2^24).")
    max_length: int = Field(3072, ge=8, le=MAX_SEQ_TOKENS,
                            description="Samples longer than this many tokens are cut to it (8..2^20).")
    grad_accum: int = Field(1, ge=1, le=1024, description="Micro-batches per rank per optimiser step (1..1024).")
    lr: float = Field(6e-4, gt=0, le=10, description="Peak learning rate (AdamW), at most 10.")
    warmup_ratio: float = Field(0.04, ge=0, lt=1, description="Share of the steps with linear learning-rate warmup.")
    decay: Literal["cosine", "linear", "constant"] = Field("cosine", description="Learning-rate decay after warmup.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final learning rate as a share of the peak.")
    weight_decay: float = Field(0.0, ge=0, le=10, description="AdamW weight decay (0..10).")
    grad_clip: float = Field(1.0, gt=0, le=1e6, description="Global gradient-norm clip (at most 10^6).")
    seed: int = Field(0, ge=0, lt=1 << 63,
                      description="Seed of initialisation, shuffling, anchor sampling and noise (0..2^63-1).")
    num_draft_layers: int = Field(5, ge=1, le=MAX_LAYERS,
                                  description="Draft decoder layers (one target layer feeds each), 1..64.")
    block_size: int = Field(16, ge=2, le=64, description="Tokens per draft block (anchor + block_size-1 masks), 2..64.")
    layer_types: list[LayerType] | None = Field(
        None, max_length=MAX_LAYERS, description="Attention of each draft layer, one entry per layer (`full_attention` or "
                          "`sliding_attention`); unset: all full attention.")
    sliding_window: int | None = Field(
        None, ge=1, le=MAX_SEQ_TOKENS, validate_default=True,
        description="Window in tokens of the `sliding_attention` layers, 1..2^20 (required when there is one).")
    mask_token: str = Field(MASK_TOKEN, min_length=1, max_length=128, description="Token filling block positions 1..B-1; the "
                                                                  "target's tokenizer must have it.")
    target_layer_ids: list[LayerId] | None = Field(
        None, min_length=1, max_length=MAX_LAYERS,
        description="Target layers read (1..64 indexes, each 0..1023, and below the target's layer count); unset: "
                    "spread over 1..L-3.")
    max_anchors: int = Field(512, ge=1, le=1 << 16, description="Anchor positions sampled per sequence per step (1..65536).")
    gamma: float = Field(7.0, gt=0, le=1e6, description="Decay of the loss weight over block positions, exp(-(k-1)/gamma).")
    noise_std: float = Field(0.0, ge=0, le=100, description="Std of Gaussian noise added to target features in training (0..100).")
    checkpoint_every: int = Field(500, ge=1, le=MAX_STEPS, description="Steps between checkpoints (one is also written at SIGTERM).")
    keep_checkpoints: int = Field(3, ge=1, le=1000, description="Most recent checkpoints kept (1..1000).")
    target_endpoint: TargetEndpointName | None = Field(
        None, description="Name of a hidden-state source the operator configured on the trainers "
                          "(DFLASH_TARGET_ENDPOINTS; `default` is DFLASH_TARGET_URL); unset: `default`. A name, never "
                          "an address: a job's tokens go only to configured targets.")
    eval_prompts: int = Field(8, ge=0, le=100_000, description="Held-out samples (not trained on): their prompts measure acceptance "
                                                   "length τ, and the samples held-out loss and accuracy, trained vs "
                                                   "untrained drafter (0: skip; at most 100000).")
    eval_max_new_tokens: int = Field(64, ge=1, le=1 << 16, description="Tokens generated per evaluation prompt (1..65536).")
    enable_thinking: bool = Field(True, description="Thinking mode the drafter serves in; must match the mode the "
                                                    "dataset was tokenized in (its manifest's `thinking`).")

    @model_validator(mode="before")
    @classmethod
    def _no_free_address(cls, data: Any) -> Any:
        return refuse_removed(data, "target_url", "target_endpoint",
                              "the trainers send a job's tokens only to targets the operator configured")

    @field_validator("layer_types")
    @classmethod
    def _layer_count(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        layers = info.data.get("num_draft_layers")
        if value is not None and layers is not None and len(value) != layers:
            raise ValueError(f"gives {len(value)} layer types but num_draft_layers is {layers}; give one per draft layer")
        return value

    @field_validator("sliding_window")
    @classmethod
    def _window_needed(cls, value: int | None, info: ValidationInfo) -> int | None:
        sliding = "sliding_attention" in (info.data.get("layer_types") or [])
        if sliding and value is None:
            raise ValueError("is required: layer_types has sliding_attention layers")
        if value is not None and not sliding and "layer_types" in info.data:
            raise ValueError("is set but no draft layer is sliding_attention (see layer_types)")
        return value
