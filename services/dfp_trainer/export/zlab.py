"""The drafter exported in the z-lab layout (the DFlash reference's), which the serving engines load.

``zlab`` (the public DFlash reference's layout; vLLM and SGLang load it as ``--speculative-config``
``model``): ``config.json`` is :meth:`DrafterConfig.to_config_dict` (the draft layers' transformers Qwen3
config, ``rope_parameters`` as the target's, ``architectures: ["DFlashDraftModel"]``, ``block_size``,
``num_target_layers``, ``dflash_config: {mask_token_id, target_layer_ids, block_size, ...}``, the
causality fields of :meth:`DrafterConfig.causality_fields`, and ``auto_map``); ``modeling_dflash.py``
beside it, so ``AutoModel.from_pretrained(dir, trust_remote_code=True)`` builds the drafter. A DSpark drafter
(:mod:`~dfp_trainer.drafter.families.dspark`): ``architectures: ["Qwen3DSparkModel"]`` and its fields instead of
``auto_map``, its heads in the weights, no modeling file; a DFlash2 drafter (:mod:`~dfp_trainer.drafter.families.dflash2`)
likewise: ``architectures: ["DFlash2DraftModel"]``, its fields in ``dflash_config``.

Both layouts (this one and :mod:`.speculators`): ``model.safetensors`` (see :mod:`.files`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..drafter import modeling_dflash
from ..drafter.family import family
from ..drafter.wrappers import unwrap
from .files import DTYPE_NAMES, write, write_json, write_weights

MODELING_FILE = "modeling_dflash.py"


def export_drafter(drafter: nn.Module, out_dir: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """The z-lab layout in ``out_dir``: ``config.json``, ``model.safetensors``, ``modeling_dflash.py``."""
    model = unwrap(drafter)
    out, dtype = write_weights(model, out_dir, dtype)
    if family(model.config.family).reference_route:  # DSpark and DFlash2 drafters are vLLM's own classes: no AutoModel class
        write(out / MODELING_FILE, Path(modeling_dflash.__file__).read_bytes())
    write_json(out / "config.json", model.config.to_config_dict(DTYPE_NAMES.get(dtype, "float32")))
    return out
