"""An exported drafter (the z-lab layout, :mod:`dfp_trainer.export.zlab`) loaded back over the target's
embedding and LM head: what the evaluate job and the serving reference decode run."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from .config import DrafterConfig
from .config_json import read_config_json
from .families import build_drafter
from .model import DFlashDrafter

MISSING = "missing from the exported drafter"


def load_exported(out_dir: str | os.PathLike, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                  device: str | torch.device | None = None) -> DFlashDrafter:
    """Load an exported drafter over the target's embedding and LM head; tensor names must match exactly."""
    from safetensors.torch import load_file

    out = Path(out_dir)
    cfg_path, weights = out / "config.json", out / "model.safetensors"
    data = read_config_json(cfg_path, MISSING)
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: {MISSING}")
    drafter = build_drafter(DrafterConfig.from_config_dict(data, str(cfg_path)), embed_tokens, lm_head)
    state = load_file(str(weights))
    expected = drafter.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{weights}: tensor names do not match the config (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(f"{weights}: tensor {name} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(expected[name].shape)}")
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
