"""Job specs: one pydantic model per job type, shared by the API (validation) and the workers.

Each service owns its spec module here; :data:`SPECS` maps a job type to its model.
"""

from __future__ import annotations

from pydantic import BaseModel

from .generate import GenerateSpec
from .pipeline import PipelineSpec
from .tokenize import TokenizeSpec
from .train import TrainSpec

SPECS: dict[str, type[BaseModel]] = {
    "generate": GenerateSpec,
    "tokenize": TokenizeSpec,
    "train": TrainSpec,
    "pipeline": PipelineSpec,
}

# the counter each job type reports its ETA by
PRIMARY_UNIT = {"generate": "prompts", "tokenize": "files", "train": "steps", "pipeline": "stages"}

__all__ = ["SPECS", "PRIMARY_UNIT", "GenerateSpec", "TokenizeSpec", "TrainSpec", "PipelineSpec"]
