"""Cutting sequences into token-budget batches and requests, and right-padding a batch.

Two budgets, one owner each: a forward pass pays for padding (rows x longest, :func:`padded_batches`),
a request carries only its tokens (:func:`plan_requests`). Both keep the input order and put a
sequence longer than the budget alone in its group.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def padded_batches(lengths: Iterable[int], token_budget: int) -> Iterator[list[int]]:
    """Sequence indices grouped in order so each right-padded batch (rows x longest) stays within the budget.

    Lazy: a group is yielded as soon as the next length does not fit it, so ``next()`` on a long
    queue reads only one length past the first batch.
    """
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        new_longest = max(longest, n)
        if current and new_longest * (len(current) + 1) > token_budget:
            yield current
            current, new_longest = [], n
        current.append(i)
        longest = new_longest
    if current:
        yield current


def plan_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Every padded batch of :func:`padded_batches`, as a list."""
    return list(padded_batches(lengths, token_budget))


def plan_requests(lengths: Iterable[int], token_budget: int | None) -> list[list[int]]:
    """Sequence indices grouped in order so each request carries at most ``token_budget`` tokens.

    No budget (``None`` or 0): one request with every sequence.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if token_budget and current and used + n > token_budget:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    return groups


def pad_batch(sequences: list[torch.Tensor], device, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) ids and attention mask."""
    longest = max(int(s.numel()) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : seq.numel()] = seq.to(torch.long)
        mask[row, : seq.numel()] = 1
    return ids.to(device), mask.to(device)
