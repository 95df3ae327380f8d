"""The drafter inside the wrappers training puts around it (DDP, ``torch.compile``)."""

from __future__ import annotations

import torch


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The drafter inside its wrappers: DDP / DataParallel keep it in ``.module``, ``torch.compile`` in
    ``._orig_mod`` (nested in any order)."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        else:
            return model
