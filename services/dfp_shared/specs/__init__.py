"""Job specs: one pydantic model per job type, shared by the API (validation) and the workers.

Each service owns its spec module here; :data:`SPECS` maps a job type to its model.
"""

from __future__ import annotations

from pydantic import BaseModel

from .evaluate import EvaluateSpec
from .generate import GenerateSpec
from .pipeline import PipelineSpec
from .tokenize import TokenizeSpec
from .train import TrainSpec

SPECS: dict[str, type[BaseModel]] = {
    "generate": GenerateSpec,
    "tokenize": TokenizeSpec,
    "train": TrainSpec,
    "pipeline": PipelineSpec,
    "evaluate": EvaluateSpec,
}

# the counter each job type reports its ETA by
PRIMARY_UNIT = {"generate": "prompts", "tokenize": "files", "train": "steps", "pipeline": "stages", "evaluate": "prompts"}

# the task stream a job type's plan task goes on, where it is not the type's own: evaluate jobs run on the
# trainer workers (they hold the target and drafter code)
TASK_STREAM = {"evaluate": "train"}

__all__ = ["SPECS", "PRIMARY_UNIT", "TASK_STREAM", "EvaluateSpec", "GenerateSpec", "TokenizeSpec", "TrainSpec", "PipelineSpec"]
