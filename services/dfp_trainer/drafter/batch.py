"""The drafter's input: one padded micro-batch (:class:`Batch`), built from the token dataset by
:func:`~dfp_trainer.components.data.collate.collate` and given the target's features by
:func:`~dfp_trainer.components.data.collate.fetch_hidden`. The model, the objective, the training loop's input
pipeline and the evaluations all speak it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """One padded micro-batch as it travels the input pipeline: built by collation (CPU, pinned on
    CUDA hosts), given its ``target_hidden`` by the fetch stage, moved by :meth:`to`, consumed by the
    objective. ``index`` are the dataset sample indices (for tracing)."""

    input_ids: torch.Tensor  # (B, T) int32 (the dataset's dtype), 0 past each length
    loss_mask: torch.Tensor  # (B, T) uint8, 0 past each length
    lengths: torch.Tensor  # (B,) int64
    index: torch.Tensor | None = None  # (B,) int64
    target_hidden: torch.Tensor | None = None  # (B, T, K*H) target features, zeros past each length

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def sequences(self) -> list[torch.Tensor]:
        """The unpadded token rows (views), as the hidden-state source takes them."""
        return [self.input_ids[i, : int(n)] for i, n in enumerate(self.lengths.tolist())]

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the training step computes with (``index`` stays on the host)."""
        return [t for t in (self.input_ids, self.loss_mask, self.lengths, self.target_hidden) if t is not None]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch with its compute tensors on ``device`` (non-blocking copies overlap from pinned memory)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return Batch(move(self.input_ids), move(self.loss_mask), move(self.lengths), self.index,
                     move(self.target_hidden))
