"""Spec of an ``import_gguf`` job (run by the trainer workers, which hold torch, transformers and gguf).

A GGUF checkpoint in storage becomes an ordinary Hugging Face model directory (safetensors weights, config,
tokenizer and chat template) that every service loads as a target: the ``models import-gguf`` command's
import (:mod:`dfp_shared.models.gguf_import`), as a job.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from dfp_shared.specs._common import StorageUri


class ImportGGUFSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    source: StorageUri = Field(description="The GGUF file (llama.cpp's format, quantised or not) to import; its size "
                                           "is bounded by the workers' DFLASH_GGUF_MAX_BYTES.")
    output: StorageUri | None = Field(
        None, description="Model directory to write (float32 safetensors, config, tokenizer, chat template); unset: a "
                          "prefix of the job's own under the storage root (<root>/jobs/<job id>/). It must be new or "
                          "created by the same principal.")
