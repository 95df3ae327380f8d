"""An exported drafter (the z-lab layout, :mod:`dfp_trainer.export.zlab`) loaded back over the target's
embedding and LM head: what the evaluate job and the serving reference decode run."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from .bounds import check_fits_target, check_weights_header
from .families import build_drafter
from .model import DFlashDrafter
from .stored import read_drafter_config

MISSING = "missing from the exported drafter"


def load_exported(out_dir: str | os.PathLike, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                  device: str | torch.device | None = None, target_config=None) -> DFlashDrafter:
    """Load an exported drafter over the target's embedding and LM head; tensor names must match exactly.
    Its config is read by :func:`~.stored.read_drafter_config`, which bounds it (:mod:`.bounds`) before anything
    is built from it, and held to ``target_config`` too, when given, before the drafter is built; the weights'
    names and shapes are checked from their header before they are read."""
    from safetensors.torch import load_file

    out = Path(out_dir)
    cfg_path, weights = out / "config.json", out / "model.safetensors"
    config, _layout = read_drafter_config(out, MISSING)
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: {MISSING}")
    try:
        if target_config is not None:
            check_fits_target(config, target_config)
        if (config.hidden_size, config.vocab_size) != tuple(embed_tokens.weight.shape)[::-1]:
            raise ValueError(f"hidden_size {config.hidden_size} and vocab_size {config.vocab_size} differ from the "
                             f"target's embedding {tuple(embed_tokens.weight.shape)}")
    except ValueError as exc:
        raise ValueError(f"{cfg_path}: {exc}") from None
    drafter = build_drafter(config, embed_tokens, lm_head)
    expected = drafter.state_dict()
    check_weights_header(str(weights), {name: tuple(t.shape) for name, t in expected.items()})
    state = load_file(str(weights))
    if "d2t" in state:
        targets = state["d2t"].long() + torch.arange(state["d2t"].numel())
        if bool((targets < 0).any() or (targets >= drafter.config.vocab_size).any()) or \
                targets.unique().numel() != targets.numel():
            raise ValueError(f"{weights}: d2t does not map the draft ids to distinct tokens of the target's "
                             f"{drafter.config.vocab_size}")
    drafter.to(state["fc.weight"].dtype)
    drafter.load_state_dict(state)
    if device is not None:
        drafter.to(device)
    return drafter
