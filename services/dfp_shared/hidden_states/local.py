"""The in-process target: the frozen model loaded in the caller's process (the embedded default).

Same interface as the gRPC client (:class:`~dfp_shared.hidden_states.HiddenStateSource`), so a
single machine trains without the target service. The forward runs on one dedicated thread
(hybrid models' linear-attention kernels must not be entered from several threads at once).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dfp_shared.hidden_states.contract import ModelInfo, resolve_layers, validate_sequences
from dfp_shared.hidden_states.forward import forward_batch
from dfp_shared.hidden_states.model_info import build_model_info
from dfp_shared.hidden_states.packing import plan_batches
from dfp_shared.models.loading import load_causal_lm, local_model_dir

log = logging.getLogger(__name__)

DEFAULT_TOKEN_BUDGET = 16384


class InProcessTarget:
    """The target model in this process; ``hidden_states`` batches its input under a token budget."""

    def __init__(self, model_dir: str | Path, device: str | None = None, dtype: str | None = None, *,
                 layer_ids: list[int] | None = None, token_budget: int = DEFAULT_TOKEN_BUDGET,
                 endpoint_url: str | None = None, model=None):
        path = local_model_dir(str(model_dir), endpoint_url=endpoint_url)
        self.model = model if model is not None else load_causal_lm(str(path), device=device, dtype=dtype)
        self.token_budget = token_budget
        self._info = build_model_info(self.model, path, layer_ids=layer_ids, max_tokens_per_request=0)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target-forward")

    def model_info(self) -> ModelInfo:
        return self._info

    def compute(self, sequences: list[torch.Tensor], layer_ids: list[int] | None = None) -> list[torch.Tensor]:
        """Blocking variant of :meth:`hidden_states` (validates, batches, runs)."""
        layers = resolve_layers(self._info, layer_ids)
        validate_sequences(self._info, sequences)
        out: list[torch.Tensor | None] = [None] * len(sequences)
        for group in plan_batches([int(s.numel()) for s in sequences], self.token_budget):
            for i, states in zip(group, forward_batch(self.model, [sequences[i] for i in group], layers)):
                out[i] = states
        return out  # type: ignore[return-value]

    async def hidden_states(self, sequences: list[torch.Tensor], layer_ids: list[int]) -> list[torch.Tensor]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.compute, sequences, layer_ids)

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
