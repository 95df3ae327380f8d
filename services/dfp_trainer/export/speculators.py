"""The drafter exported in vLLM's speculators layout.

``speculators`` (vLLM's native speculators layout, ``vllm serve DIR`` serves the verifier it names with
the drafter): ``speculators_model_type: "dflash"``, the Qwen3 config as ``transformer_layer_config``,
``aux_hidden_state_layer_ids``: vLLM maps them to ``dflash_config.target_layer_ids = ids - 1`` (its
capture points precede a layer), so they are the project's ``target_layer_ids + 1``;
``sliding_window_non_causal`` becomes ``dflash_config.causal`` for every layer at once, so this layout
serves all-full drafters (non-causal) and all-sliding ones (causal), not a mix.

The weights: ``model.safetensors`` as in the z-lab layout (see :mod:`.files`), a pruned vocabulary's
``lm_head.weight`` and ``d2t`` included: vLLM's speculators config passes ``draft_vocab_size`` on to the same
DFlash model, which loads them as from the z-lab layout.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..drafter import modeling_dflash
from ..drafter.config import DrafterConfig
from ..drafter.wrappers import unwrap
from .files import DTYPE_NAMES, write_json, write_weights

# z-lab config.json keys that are not the draft layers' transformers config (the speculators layout states them apart)
_NOT_LAYER_CONFIG = ("architectures", "auto_map", "is_causal", "block_size", "num_target_layers", "dflash_config",
                     "dtype", "draft_vocab_size")


def export_speculators(drafter: nn.Module, out_dir: str | os.PathLike, verifier: str,
                       verifier_architectures: list[str] | None = None, dtype: torch.dtype | None = None) -> Path:
    """The speculators layout in ``out_dir`` (``config.json``, ``model.safetensors``); ``verifier`` is the
    target model as the serving machine names it (a local directory or a hub id)."""
    model = unwrap(drafter)
    config = speculators_config(model.config, verifier, verifier_architectures)  # refuses a mixed layout first
    out, dtype = write_weights(model, out_dir, dtype)
    write_json(out / "config.json", {**config, "dtype": DTYPE_NAMES.get(dtype, "float32")})
    return out


def speculators_config(config: DrafterConfig, verifier: str, verifier_architectures: list[str] | None = None) -> dict:
    """vLLM's speculators ``config.json`` for a drafter (see the module docstring for the layer ids)."""
    kinds = set(config.layer_types)
    if len(kinds) > 1:
        raise ValueError(f"the speculators layout cannot serve layer_types {config.layer_types}: vLLM applies its "
                         f"one causality flag to every layer, and full layers attend to their whole block while "
                         f"sliding layers are causal; export the zlab layout for a mixed drafter")
    zlab = config.to_config_dict()
    layer_config = {k: v for k, v in zlab.items() if k not in _NOT_LAYER_CONFIG}
    return {"speculators_model_type": "dflash", "architectures": ["DFlashDraftModel"],
            "transformer_layer_config": layer_config,
            "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
            "mask_token_id": config.mask_token_id, "block_size": config.block_size,
            "target_hidden_size": config.hidden_size,
            "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
            "num_target_layers": config.num_target_layers,
            "sliding_window_non_causal": kinds != {modeling_dflash.SLIDING_ATTENTION},
            "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": config.block_size - 1}],
                                   "verifier": {"name_or_path": verifier,
                                                "architectures": list(verifier_architectures or [])}}}
