"""The hidden-state contract the trainer codes to: what a source serves, how it is asked, how it fails.

A :class:`HiddenStateSource` returns, for each 1-D tensor of token ids, a tensor
``(len_i, len(layer_ids) * hidden)``: the output of each requested decoder layer ``i`` (Hugging
Face ``hidden_states[i + 1]``) concatenated on the last dimension, in request order. Two
implementations share it: the in-process target (:mod:`.local`) and the gRPC client
(:mod:`.client`); the target service runs the same forward pass (:mod:`.forward`) as the
in-process target, so both give bit-identical results on the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class ModelInfo:
    """What a hidden-state source serves."""

    model_id: str  # the name clients see (the checkpoint directory's by default)
    fingerprint: str  # of the checkpoint (its config and weight files)
    num_layers: int  # decoder layers of the model
    hidden_size: int  # H: each served layer adds H columns
    vocab_size: int  # token ids must lie in [0, vocab_size)
    dtype: str  # of the returned states (a tensor-codec name)
    layer_ids: list[int]  # the layers a request may ask for
    max_tokens_per_request: int  # 0: no limit
    tokenizer_fingerprint: str = ""  # of the tokenizer saved beside the checkpoint ("" when none)
    max_sequence_length: int = 0  # 0: not known
    max_message_bytes: int = 0  # the gRPC message limit of a served target (0: none)
    extra: dict = field(default_factory=dict)  # not on the wire


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
