"""The drafter families: which module builds a drafter of a config (:attr:`DrafterConfig.family
<dfp_trainer.drafter.config.DrafterConfig.family>`). Each family shares the DFlash backbone, masks and objective."""

from __future__ import annotations

import torch
from torch import nn

from .config import DrafterConfig
from .dflash2 import DFlash2Drafter
from .dspark import DSparkDrafter
from .model import DFlashDrafter

FAMILIES: dict[str, type[DFlashDrafter]] = {"dflash": DFlashDrafter, "dspark": DSparkDrafter,
                                             "dflash2": DFlash2Drafter}


def build_drafter(config: DrafterConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                  draft_ids: torch.Tensor | None = None) -> DFlashDrafter:
    """The drafter module of the config's family over the target's embedding and LM head."""
    return FAMILIES[config.family](config, embed_tokens, lm_head, draft_ids)
