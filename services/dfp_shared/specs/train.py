"""Spec of a ``train`` job (owned by the trainer service)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..tokenizer_assets import MASK_TOKEN
from ._common import StorageUri

LayerType = Literal["full_attention", "sliding_attention"]


class TrainSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset: StorageUri = Field(description="Tokenized dataset prefix (with its manifest).")
    target: StorageUri = Field(description="Target model directory (local or object storage).")
    output: StorageUri | None = Field(
        None, description="Prefix for checkpoints, the drafter export and the eval report; unset: a prefix of the job's own under the storage "
                          "root (<root>/jobs/<job id>/). It must be new or created by the same principal.")

    steps: int | None = Field(None, ge=1, description="Optimiser steps to train; unset: `epochs` passes over the data.")
    epochs: float = Field(3.0, gt=0, description="Passes over the dataset when `steps` is unset.")
    tokens_per_batch: int = Field(16384, ge=16, description="Padded tokens per optimiser step, all ranks together.")
    max_length: int = Field(3072, ge=8, description="Samples longer than this many tokens are cut to it.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per rank per optimiser step.")
    lr: float = Field(6e-4, gt=0, description="Peak learning rate (AdamW).")
    warmup_ratio: float = Field(0.04, ge=0, lt=1, description="Share of the steps with linear learning-rate warmup.")
    decay: Literal["cosine", "linear", "constant"] = Field("cosine", description="Learning-rate decay after warmup.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Final learning rate as a share of the peak.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    seed: int = Field(0, description="Seed of initialisation, shuffling, anchor sampling and noise.")
    num_draft_layers: int = Field(5, ge=1, description="Draft decoder layers (one target layer feeds each).")
    block_size: int = Field(16, ge=2, description="Tokens per draft block (anchor + block_size-1 masks).")
    layer_types: list[LayerType] | None = Field(
        None, description="Attention of each draft layer, one entry per layer (`full_attention` or "
                          "`sliding_attention`); unset: all full attention.")
    sliding_window: int | None = Field(
        None, ge=1, validate_default=True,
        description="Window in tokens of the `sliding_attention` layers (required when there is one).")
    mask_token: str = Field(MASK_TOKEN, min_length=1, description="Token filling block positions 1..B-1; the "
                                                                  "target's tokenizer must have it.")
    target_layer_ids: list[int] | None = Field(None, description="Target layers read; unset: spread over 1..L-3.")
    max_anchors: int = Field(512, ge=1, description="Anchor positions sampled per sequence per step.")
    gamma: float = Field(7.0, gt=0, description="Decay of the loss weight over block positions, exp(-(k-1)/gamma).")
    noise_std: float = Field(0.0, ge=0, description="Std of Gaussian noise added to target features in training.")
    checkpoint_every: int = Field(500, ge=1, description="Steps between checkpoints (one is also written at SIGTERM).")
    keep_checkpoints: int = Field(3, ge=1, description="Most recent checkpoints kept.")
    target_url: str | None = Field(None, description="Hidden-state source override: `inprocess` or gRPC address(es).")
    eval_prompts: int = Field(8, ge=0, description="Held-out samples (not trained on): their prompts measure acceptance "
                                                   "length τ, and the samples held-out loss and accuracy, trained vs "
                                                   "untrained drafter (0: skip).")
    eval_max_new_tokens: int = Field(64, ge=1, description="Tokens generated per evaluation prompt.")
    enable_thinking: bool = Field(True, description="Thinking mode the drafter serves in; must match the mode the "
                                                    "dataset was tokenized in (its manifest's `thinking`).")

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
