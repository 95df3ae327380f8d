"""The engine interface and the request/result types."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float
    top_p: float
    max_new_tokens: int
    thinking: bool


@dataclass(frozen=True)
class GenRequest:
    id: str
    """Record id (the prompt id, with ``#<sample>`` when several samples are drawn)."""
    messages: list[dict]
    seed: int


@dataclass
class GenResult:
    id: str
    content: str = ""
    reasoning: str | None = None
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    """Set when the request failed for good (after retries); the other fields are then meaningless."""
    attempts: int = 1

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    def to_dict(self) -> dict:
        return asdict(self)


ResultCallback = Callable[[GenResult], None]
StopCheck = Callable[[], bool]


def derive_seed(base: int, prompt_id: str, sample: int) -> int:
    """A per-(prompt, sample) seed, stable across runs and machines."""
    digest = hashlib.sha256(f"{base}\x00{prompt_id}\x00{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class Engine(ABC):
    """Generates one completion per request. Implementations never raise for one bad request:
    they return a result with ``error`` set; they raise only when the engine itself is unusable."""

    name: str = ""
    model_name: str = ""

    @abstractmethod
    def generate(self, requests: list[GenRequest], params: SamplingParams, *, on_result: ResultCallback | None = None,
                 should_stop: StopCheck | None = None) -> list[GenResult]:
        """Results of the requests that ran, in any order; ``on_result`` sees each as it finishes.
        When ``should_stop`` turns true, no new request starts and the finished ones are returned."""

    def close(self) -> None:  # noqa: B027 - optional hook; engines without resources keep it empty
        """Release the engine's resources."""
