"""The drafter families, one folder each (torchtitan's ``models/<name>/``): a family's ``__init__`` declares its
:class:`~dfp_trainer.drafter.family.DrafterFamily` (module, config fields and checks, ``config.json`` fields, how
it is served), its modules beside it. Each shares the DFlash backbone, masks and objective of
:mod:`dfp_trainer.drafter` and imports nothing else of the trainer (nor another family).

Adding a family: a folder here declaring ``FAMILY``, and its line below; a family trainable from a job spec also
adds its row to :mod:`dfp_shared.specs.families` (its spec fields and export layouts)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import DrafterConfig
from ..family import FAMILIES, family, register
from ..model import DFlashDrafter
from .dflash import FAMILY as DFLASH
from .dflash2 import FAMILY as DFLASH2
from .dspark import FAMILY as DSPARK

for _family in (DFLASH, DSPARK, DFLASH2):  # the registry: one line per family, in the order architectures are tried
    register(_family)

__all__ = ["FAMILIES", "build_drafter", "register"]


def build_drafter(config: DrafterConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                  draft_ids: torch.Tensor | None = None) -> DFlashDrafter:
    """The drafter module of the config's family over the target's embedding and LM head."""
    return family(config.family).module(config, embed_tokens, lm_head, draft_ids)
