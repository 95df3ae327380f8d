"""One training run's configuration: the job spec (what is asked) and the trainer settings (where it
runs), composed once where the run starts and passed down; the drafter's config is derived from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dfp_shared.specs.train import TrainSpec

from .drafter.config import DrafterConfig
from .drafter.family import family
from .settings import TrainerSettings


@dataclass(frozen=True)
class RunConfig:
    spec: TrainSpec  # the train job: data, target, output, recipe, drafter shape
    settings: TrainerSettings  # this trainer: device, endpoints, S3, pipeline depth, progress, scratch
    target_address: str  # the hidden-state source the spec's target_endpoint names: `inprocess` or gRPC
    resume: bool = True  # continue from the latest checkpoint under the output prefix, if any
    evaluate: bool = True  # hold out samples, measure tau and held-out metrics, write the report

    @classmethod
    def compose(cls, spec: TrainSpec, settings: TrainerSettings, *, resume: bool = True,
                evaluate: bool = True) -> RunConfig:
        """The run of ``spec`` on this trainer; ValueError when the spec names a target endpoint the
        settings do not configure (a spec names a source, never an address)."""
        return cls(spec, settings, settings.target_address(spec.target_endpoint), resume=resume, evaluate=evaluate)

    def output_uri(self, part: str) -> str:
        """``part`` under the run's output prefix."""
        return self.spec.output.rstrip("/") + "/" + part

    def drafter_config(self, target_config: Any, mask_token_id: int) -> DrafterConfig:
        """The drafter this run trains, sized to the target (a HF config or its ``config.json`` dict)."""
        spec = self.spec
        return DrafterConfig.for_target(target_config, num_layers=spec.num_draft_layers, block_size=spec.block_size,
                                        mask_token_id=mask_token_id, target_layer_ids=spec.target_layer_ids,
                                        layer_types=spec.layer_types, sliding_window=spec.sliding_window,
                                        draft_vocab_size=spec.draft_vocab_size, family=spec.family,
                                        **{name: getattr(spec, name) for name in family(spec.family).config_fields})
