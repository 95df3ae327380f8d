"""Generation engines behind one interface: ``transformers`` (in-process) and ``openai`` (HTTP)."""

from .base import Engine, GenRequest, GenResult, SamplingParams

__all__ = ["Engine", "GenRequest", "GenResult", "SamplingParams"]
