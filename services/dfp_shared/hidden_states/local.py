"""The in-process target: the frozen model loaded in the caller's process (the embedded default).

Same interface as the gRPC client (:class:`~dfp_shared.hidden_states.HiddenStateSource`), so a
single machine trains without the target service. The forward runs on one dedicated thread
(hybrid models' linear-attention kernels must not be entered from several threads at once).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .hidden_states import ModelInfo, forward_batch, plan_batches, resolve_layers, validate_sequences
from .models import load_causal_lm, local_model_dir, model_fingerprint, text_config
from .tensor_codec import dtype_name

log = logging.getLogger(__name__)

DEFAULT_TOKEN_BUDGET = 16384


def build_model_info(model, model_dir: str | Path, *, model_id: str | None = None, layer_ids: list[int] | None = None,
                     max_tokens_per_request: int = 65536, max_message_bytes: int = 0) -> ModelInfo:
    """Describe a loaded model: the served layers default to every decoder layer."""
    cfg = text_config(model.config)
    num_layers = int(cfg.num_hidden_layers)
    served = sorted(set(layer_ids)) if layer_ids else list(range(num_layers))
    bad = [i for i in served if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} do not exist in a model with {num_layers} layers")
    path = Path(model_dir)
    return ModelInfo(
        model_id=model_id or path.name,
        fingerprint=model_fingerprint(path),
        num_layers=num_layers,
        hidden_size=int(cfg.hidden_size),
        vocab_size=int(cfg.vocab_size),
        dtype=dtype_name(next(model.parameters()).dtype),
        layer_ids=served,
        max_tokens_per_request=max_tokens_per_request,
        tokenizer_fingerprint=_tokenizer_fingerprint(str(path.resolve())),
        max_sequence_length=int(getattr(cfg, "max_position_embeddings", 0) or 0),
        max_message_bytes=max_message_bytes,
    )


@functools.lru_cache(maxsize=16)
def _tokenizer_fingerprint(path: str) -> str:
    """Fingerprint of the tokenizer saved beside the checkpoint ("" when there is none)."""
    if not (Path(path) / "tokenizer.json").exists() and not (Path(path) / "tokenizer_config.json").exists():
        return ""
    from .tokenizer_assets import load_tokenizer, tokenizer_fingerprint

    return tokenizer_fingerprint(load_tokenizer(path))


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
