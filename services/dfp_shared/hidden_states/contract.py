"""Hidden states of a frozen target model: the contract the trainer codes to, and the forward pass.

A :class:`HiddenStateSource` returns, for each 1-D tensor of token ids, a tensor
``(len_i, len(layer_ids) * hidden)``: the output of each requested decoder layer ``i`` (Hugging
Face ``hidden_states[i + 1]``) concatenated on the last dimension, in request order. Two
implementations share it: the in-process target (``target_local``) and the gRPC client
(``target_client``); the target service runs :func:`forward_batch` exactly as the in-process
target does, so both give bit-identical results on the same batch.

Only the requested layers are captured (forward hooks on the decoder layers) and the forward stops
after the deepest one, so neither the remaining layers, the LM head nor all layers' states are
computed or kept.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class ModelInfo:
    """What a hidden-state source serves."""

    model_id: str
    fingerprint: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str
    layer_ids: list[int]
    max_tokens_per_request: int
    tokenizer_fingerprint: str = ""
    max_sequence_length: int = 0
    max_message_bytes: int = 0
    extra: dict = field(default_factory=dict)


@runtime_checkable
class HiddenStateSource(Protocol):
    def model_info(self) -> ModelInfo: ...

    async def hidden_states(self, sequences: list[torch.Tensor], layer_ids: list[int]) -> list[torch.Tensor]: ...

    async def close(self) -> None: ...


class InvalidInput(ValueError):
    """A request the source cannot serve; the message names the sequence and the reason."""


class SourceUnavailable(RuntimeError):
    """The hidden-state source could not be reached after all retries."""


def resolve_layers(info: ModelInfo, layer_ids: list[int] | None) -> list[int]:
    """The layer ids to return (all served ones when empty); unknown ids raise :class:`InvalidInput`."""
    if not layer_ids:
        return list(info.layer_ids)
    served = set(info.layer_ids)
    unknown = [i for i in layer_ids if i not in served]
    if unknown:
        raise InvalidInput(f"unknown layer ids {unknown}: this target serves layers {sorted(served)}")
    if len(set(layer_ids)) != len(layer_ids):
        raise InvalidInput(f"layer ids {list(layer_ids)} contain duplicates")
    return list(layer_ids)


def validate_sequences(info: ModelInfo, sequences: list[torch.Tensor], numbers: list[int] | None = None) -> None:
    """Raise :class:`InvalidInput` naming the first bad sequence (dtype, emptiness, length, vocabulary)."""
    if not sequences:
        raise InvalidInput("no sequences in the request")
    numbers = numbers or list(range(len(sequences)))
    total = 0
    for n, seq in zip(numbers, sequences):
        if seq.dtype not in (torch.int32, torch.int64):
            raise InvalidInput(f"sequence {n}: token ids must be integers (int32), got {seq.dtype}")
        if seq.dim() != 1:
            raise InvalidInput(f"sequence {n}: token ids must be a 1-D tensor, got shape {list(seq.shape)}")
        length = seq.numel()
        if length == 0:
            raise InvalidInput(f"sequence {n}: empty sequence")
        if info.max_sequence_length and length > info.max_sequence_length:
            raise InvalidInput(f"sequence {n}: {length} tokens exceed the maximum sequence length "
                               f"{info.max_sequence_length}")
        lo, hi = int(seq.min()), int(seq.max())
        if lo < 0 or hi >= info.vocab_size:
            bad = lo if lo < 0 else hi
            pos = int(((seq < 0) | (seq >= info.vocab_size)).nonzero()[0])
            raise InvalidInput(f"sequence {n}: token id {bad} at position {pos} is outside the vocabulary "
                               f"[0, {info.vocab_size})")
        total += length
    if info.max_tokens_per_request and total > info.max_tokens_per_request:
        raise InvalidInput(f"request of {total} tokens exceeds max_tokens_per_request {info.max_tokens_per_request}; "
                           "split it into smaller requests")


# ---------------------------------------------------------------- the forward pass


class _StopForward(Exception):
    pass


def decoder_of(model):
    """The base decoder (with ``layers`` and ``norm``) of a causal LM, also inside multimodal wrappers."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if not hasattr(base, "layers") and hasattr(base, "language_model"):
        base = base.language_model
    return base


def capture_layers(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Outputs of ``layer_ids`` for a (B, T) batch, concatenated: (B, T, K*H); stops after the deepest layer.

    Equals Hugging Face ``hidden_states[i + 1]`` for each layer ``i`` (for the last layer that is the
    final-normed output, as Hugging Face reports it).
    """
    base = decoder_of(model)
    layers = base.layers
    wanted = set(layer_ids)
    deepest = max(wanted)
    captured: dict[int, torch.Tensor] = {}

    def hook(index):
        def fn(_module, _args, output):
            captured[index] = output[0] if isinstance(output, tuple) else output
            if index == deepest:
                raise _StopForward

        return fn

    with _model_lock(model):  # hooks are per-model state: one capture at a time per model
        return _capture(base, layers, wanted, deepest, captured, hook, input_ids, attention_mask, layer_ids)


def _model_lock(model) -> threading.Lock:
    return model.__dict__.setdefault("_dflash_capture_lock", threading.Lock())


def _capture(base, layers, wanted, deepest, captured, hook, input_ids, attention_mask, layer_ids):
    handles = [layers[i].register_forward_hook(hook(i)) for i in sorted(wanted)]
    try:
        with torch.inference_mode():
            try:
                base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            except _StopForward:
                pass
            if len(layers) - 1 in captured:  # HF reports the last layer after the final norm
                captured[len(layers) - 1] = base.norm(captured[len(layers) - 1])
    finally:
        for h in handles:
            h.remove()
    return torch.cat([captured[i] for i in layer_ids], dim=-1)  # (B, T, K*H)


def pad_batch(sequences: list[torch.Tensor], device, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) ids and attention mask."""
    longest = max(int(s.numel()) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : seq.numel()] = seq.to(torch.long)
        mask[row, : seq.numel()] = 1
    return ids.to(device), mask.to(device)


def forward_batch(model, sequences: list[torch.Tensor], layer_ids: list[int]) -> list[torch.Tensor]:
    """One right-padded forward over ``sequences``; per sequence its (len_i, K*H) states on the CPU."""
    device = next(model.parameters()).device
    ids, mask = pad_batch(sequences, device)
    states = capture_layers(model, ids, mask, layer_ids)  # (B, T, K*H)
    out = []
    for row, seq in enumerate(sequences):
        out.append(states[row, : seq.numel()].to("cpu", copy=False).contiguous())
    return out


def plan_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group sequence indices in order so each padded batch (rows * longest) stays within ``token_budget``."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        new_longest = max(longest, n)
        if current and new_longest * (len(current) + 1) > token_budget:
            batches.append(current)
            current, new_longest = [], n
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches
