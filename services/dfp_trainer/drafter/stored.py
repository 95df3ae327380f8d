"""A stored drafter's ``config.json`` read into a :class:`~.config.DrafterConfig`: the one reader of every loader
of a drafter from storage (an exported drafter loaded back by :func:`~.load.load_exported`, which the ``evaluate``
job and the serving reference run; a run's ``init_from``, :func:`~.warm_start.warm_start`).

The file is a user's: it is read no further than :data:`~dfp_shared.models.loading.MAX_CONFIG_BYTES`, and every field
that sizes something is bounded on the dict read from it (:func:`~.bounds.check_config_dict`, the first thing
:meth:`DrafterConfig.from_config_dict` does) before any object, list or tensor is built from it. A config in
vLLM speculators' layout (``speculators_model_type: dflash``, where a loader takes it) has its per-layer list
bounded before it is rewritten into the z-lab fields, which are then bounded the same way. No code a config
names (``auto_map``) is ever run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from . import families  # noqa: F401  the families register before a config names one
from .bounds import check_layer_list
from .config import DrafterConfig
from .config_json import read_config_json

ZLAB, SPECULATORS = "zlab", "speculators"


def read_drafter_config(directory: str | os.PathLike, missing: str, layouts: tuple[str, ...] = (ZLAB,),
                        num_target_layers: int | None = None) -> tuple[DrafterConfig, str]:
    """The config of the drafter stored in ``directory`` and its layout (one of ``layouts``). FileNotFoundError
    ``"<file>: {missing}"`` when there is no ``config.json``; ValueError naming the file, the field, its value and
    its bound when a field is out of bounds or the config is no drafter's. ``num_target_layers``: the run's, for a
    speculators file that does not state it."""
    path = Path(directory) / "config.json"
    data = read_config_json(path, missing)
    layout = SPECULATORS if "speculators_model_type" in data else ZLAB
    if layout not in layouts:
        raise ValueError(f"{path}: a drafter in the {layout} layout; this loader reads {' or '.join(layouts)}")
    if layout == SPECULATORS:
        data = speculators_as_zlab(data, str(path), num_target_layers)
    elif "auto_map" in data and not data.get("dflash_config"):
        raise ValueError(f"{path}: a config that names model code but no dflash_config: not a drafter that can be "
                         "loaded here (no code is run)")
    try:
        return DrafterConfig.from_config_dict(data, str(path)), layout
    except (TypeError, KeyError, AttributeError, OverflowError) as exc:  # a field of the wrong kind, past the bounds
        raise ValueError(f"{path}: not a drafter config this loader reads ({type(exc).__name__}: "
                         f"{str(exc)[:200]})") from None


def speculators_as_zlab(data: dict[str, Any], source: str, num_target_layers: int | None) -> dict[str, Any]:
    """A speculators ``config.json`` as the z-lab fields :meth:`DrafterConfig.from_config_dict` reads (a
    speculators file's ``aux_hidden_state_layer_ids`` are the target layer ids plus one)."""
    if data.get("speculators_model_type") != "dflash":
        raise ValueError(f"{source}: speculators_model_type {str(data.get('speculators_model_type'))[:40]!r} is not "
                         "a DFlash drafter (expected 'dflash')")
    layers = data.get("transformer_layer_config")
    if not isinstance(layers, dict):
        raise ValueError(f"{source}: field transformer_layer_config missing (the draft layers' config)")
    aux = data.get("aux_hidden_state_layer_ids")
    try:
        check_layer_list("aux_hidden_state_layer_ids", aux)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    if not aux or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux):
        raise ValueError(f"{source}: field aux_hidden_state_layer_ids missing or not a list of layer ids")
    for name in ("mask_token_id", "block_size"):
        if not isinstance(data.get(name), int) or isinstance(data.get(name), bool):
            raise ValueError(f"{source}: field {name} missing or not an integer")
    architectures = data.get("architectures") or ["DFlashDraftModel"]
    if not isinstance(architectures, list):
        raise ValueError(f"{source}: field architectures is not a list")
    vocab = layers.get("vocab_size")
    draft_vocab = data.get("draft_vocab_size")
    return {**{k: v for k, v in layers.items() if k not in ("architectures", "auto_map", "dflash_config")},
            "architectures": architectures,
            "num_target_layers": data.get("num_target_layers") or num_target_layers,
            "block_size": data["block_size"],
            "draft_vocab_size": None if draft_vocab in (None, vocab) else draft_vocab,
            "dflash_config": {"mask_token_id": data["mask_token_id"], "block_size": data["block_size"],
                              "target_layer_ids": [i - 1 for i in aux]}}
