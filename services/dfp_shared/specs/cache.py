"""Spec of a ``cache`` job (owned by the trainer service, whose workers run it).

Fills a hidden-state cache offline: the target's features of every sample of a token dataset, for the
layers a drafter will read, so that a train job with ``hidden_states: offline`` runs without a target.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from dfp_shared.specs._common import StorageUri
from dfp_shared.specs.train import MAX_LAYERS, LayerId, TargetEndpointName


class CacheSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    dataset: StorageUri = Field(description="Tokenized dataset prefix (with its manifest).")
    target: StorageUri = Field(description="Target model directory (local or object storage).")
    output: StorageUri | None = Field(None, description="Prefix of the cache (a train spec's `hidden_state_cache`); "
                                      "unset: a prefix of the job's own under the storage root (<root>/jobs/<job id>/). "
                                      "It must be new or created by the same principal.")
    num_draft_layers: int = Field(5, ge=1, le=MAX_LAYERS,
                                  description="Draft layers of the drafter the cache is for: unless `target_layer_ids` "
                                              f"is set, one target layer each, as a train job picks them (1..{MAX_LAYERS}).")
    target_layer_ids: list[LayerId] | None = Field(
        None, min_length=1, max_length=MAX_LAYERS,
        description="Target layers cached (1..64 indexes, each 0..1023, and below the target's layer count); unset: "
                    "the train job's default for `num_draft_layers`.")
    distill: bool = Field(False, description="Also cache the target's last layer (after its final norm), after the "
                                             "drafter's: what a train job with `distill_weight` > 0 or `labels: "
                                             "target_argmax` reads the teacher's logits from.")
    target_endpoint: TargetEndpointName | None = Field(
        None, description="Name of a hidden-state source the operator configured on the trainers "
                          "(DFLASH_TARGET_ENDPOINTS; `default` is DFLASH_TARGET_URL); unset: `default`.")
