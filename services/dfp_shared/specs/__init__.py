"""Job specs: one pydantic model per job type, shared by the API (validation) and the workers.

Each service owns its spec module here; :mod:`dfp_shared.job_types` says which model is which type's.
"""

from __future__ import annotations

from .cache import CacheSpec
from .evaluate import EvaluateSpec
from .generate import GenerateSpec
from .import_gguf import ImportGGUFSpec
from .pipeline import PipelineSpec
from .tokenize import TokenizeSpec
from .train import TrainSpec

__all__ = ["CacheSpec", "EvaluateSpec", "GenerateSpec", "ImportGGUFSpec", "TokenizeSpec", "TrainSpec", "PipelineSpec"]
