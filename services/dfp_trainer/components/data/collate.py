"""Collation: the drafter's :class:`~dfp_trainer.drafter.batch.Batch` built from the token dataset
(:func:`collate`) and given the target's features by the hidden-state source (:func:`fetch_hidden`).
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch
from dfp_shared.hidden_states import plan_requests
from dfp_shared.records.token_shards import TokenDataset

from ...drafter.batch import Batch


def collate(ds: TokenDataset, indices: torch.Tensor, max_length: int, pin: bool = False) -> Batch:
    """Copy samples into padded tensors: one contiguous slice copy per row from the flat buffers (the
    samples are contiguous there), into zero-filled (optionally pinned) outputs. Token ids stay int32
    (the device-side embedding takes them as they are). Samples longer than ``max_length`` keep their
    first ``max_length`` tokens.

    The work runs on numpy views of the same memory (no copies): a slice copy costs about a
    microsecond there, several times less than through torch's per-op dispatch.
    """
    idx = indices.to(torch.int64).numpy()
    offsets = ds.offsets.numpy()
    starts = offsets[idx]  # (B,)
    lengths = np.minimum(offsets[idx + 1] - starts, max_length)  # (B,)
    width = int(lengths.max()) if len(idx) else 0
    if pin and torch.cuda.is_available():
        ids = torch.zeros(len(idx), width, dtype=ds.input_ids.dtype, pin_memory=True)  # (B, T)
        mask = torch.zeros(len(idx), width, dtype=ds.loss_mask.dtype, pin_memory=True)  # (B, T)
        ids_np, mask_np = ids.numpy(), mask.numpy()
    else:
        ids_np = np.zeros((len(idx), width), dtype=ds.input_ids.numpy().dtype)
        mask_np = np.zeros((len(idx), width), dtype=np.uint8)
        ids, mask = torch.from_numpy(ids_np), torch.from_numpy(mask_np)
    src_ids, src_mask = ds.input_ids.numpy(), ds.loss_mask.numpy()
    for row, (a, n) in enumerate(zip(starts.tolist(), lengths.tolist(), strict=True)):
        ids_np[row, :n] = src_ids[a:a + n]
        mask_np[row, :n] = src_mask[a:a + n]
    return Batch(ids, mask, torch.from_numpy(lengths), torch.from_numpy(idx))


async def fetch_hidden(source, sequences: list[torch.Tensor], layer_ids: list[int],
                       max_tokens_per_request: int | None = None, pin: bool = False,
                       index: torch.Tensor | None = None) -> torch.Tensor:
    """Hidden states of the sequences as one padded ``(B, T, K*H)`` tensor (zeros past each length).

    Sequences are sent in requests of at most ``max_tokens_per_request`` tokens, all concurrently; a source
    that serves dataset samples (a hidden-state cache's ``sample_states``) is asked by the samples' ``index``.
    """
    by_sample = index is not None and hasattr(source, "sample_states")
    groups = plan_requests([int(s.numel()) for s in sequences], None if by_sample else max_tokens_per_request)
    if by_sample:
        results = [await source.sample_states([int(i) for i in index.tolist()], sequences, layer_ids)]
    else:
        results = await asyncio.gather(*(source.hidden_states([sequences[i] for i in g], layer_ids)
                                         for g in groups))
    flat: list[torch.Tensor] = [None] * len(sequences)  # type: ignore[list-item]
    for g, res in zip(groups, results, strict=True):
        if len(res) != len(g):
            raise RuntimeError(f"hidden-state source returned {len(res)} results for {len(g)} sequences")
        for i, h in zip(g, res, strict=True):
            flat[i] = h
    width = max(int(s.numel()) for s in sequences)
    feat = flat[0].shape[-1]
    out = torch.zeros(len(sequences), width, feat, dtype=flat[0].dtype,
                      pin_memory=pin and torch.cuda.is_available())  # (B, T, K*H)
    for i, h in enumerate(flat):
        if h.shape[0] != sequences[i].numel():
            raise RuntimeError(f"hidden states of sequence {i} have {h.shape[0]} rows for {sequences[i].numel()} tokens")
        out[i, : h.shape[0]] = h
    return out
