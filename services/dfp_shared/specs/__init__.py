"""Job specs: one pydantic model per job type, shared by the API (validation) and the workers.

Each service owns its spec module here; :mod:`dfp_shared.jobs.types` says which model is which type's.
"""

from __future__ import annotations

from dfp_shared.specs.cache import CacheSpec
from dfp_shared.specs.evaluate import EvaluateSpec
from dfp_shared.specs.generate import GenerateSpec
from dfp_shared.specs.import_gguf import ImportGGUFSpec
from dfp_shared.specs.pipeline import PipelineSpec
from dfp_shared.specs.tokenize import TokenizeSpec
from dfp_shared.specs.train import TrainSpec

__all__ = ["CacheSpec", "EvaluateSpec", "GenerateSpec", "ImportGGUFSpec", "TokenizeSpec", "TrainSpec", "PipelineSpec"]
