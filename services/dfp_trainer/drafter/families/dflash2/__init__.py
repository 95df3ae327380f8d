"""DFlash2: the DFlash drafter plus in-block grouped convolutions and a top-k candidate selector (:mod:`.model`), as
vLLM serves it (``architectures: ["DFlash2DraftModel"]``, method ``dflash``, its V2 runner; the z-lab layout only,
its fields in ``dflash_config``; the target's whole vocabulary)."""

from __future__ import annotations

from dfp_shared.specs.train import (
    DFLASH2_FIELDS,
    MAX_BLOCK_SIZE,
    MAX_CONV_GROUP,
    MAX_SELECTOR_RANK,
    MAX_SELECTOR_TOP_K,
)

from ...family import DrafterFamily
from .model import DFlash2Drafter

ARCHITECTURE = "DFlash2DraftModel"  # vLLM's DFlash2Qwen3ForCausalLM (served as method ``dflash``)
# dflash_config keys vLLM's DFlash2 reads with a default; the project drafts at these values only
FIXED = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": 0.0}
# the fields' train spec bounds, checked on a config.json before they are read (a kernel at most a block's tokens)
BOUNDS = (("dflash_config.conv_kernel_size", 1, MAX_BLOCK_SIZE),
          ("dflash_config.conv_group_size", 1, MAX_CONV_GROUP),
          ("dflash_config.selector_rank", 1, MAX_SELECTOR_RANK),
          ("dflash_config.selector_top_k", 1, MAX_SELECTOR_TOP_K))


def _validate(config) -> None:
    if any(getattr(config, name) is None for name in DFLASH2_FIELDS):
        raise ValueError(f"a DFlash2 drafter needs all of {', '.join(DFLASH2_FIELDS)}")
    if config.pruned:
        raise ValueError("a DFlash2 drafter drafts the target's whole vocabulary: vLLM takes its candidates' ids "
                         "from the LM head's rows without mapping them by d2t")
    for name, low, high in (("conv_kernel_size", 1, config.block_size), ("conv_group_size", 1, MAX_CONV_GROUP),
                            ("selector_rank", 1, MAX_SELECTOR_RANK),
                            ("selector_top_k", 1, min(MAX_SELECTOR_TOP_K, config.vocab_size))):
        if not low <= int(getattr(config, name)) <= high:
            raise ValueError(f"{name} must be {low}..{high}, got {getattr(config, name)}")
    if config.hidden_size % int(config.conv_group_size):
        raise ValueError(f"conv_group_size {config.conv_group_size} does not divide hidden_size {config.hidden_size}")
    coefficients = 2 * int(config.conv_kernel_size) * (config.hidden_size // int(config.conv_group_size))
    if coefficients > config.hidden_size:  # each convolution's coefficient projection at most H x H
        raise ValueError(f"conv_kernel_size {config.conv_kernel_size} with conv_group_size {config.conv_group_size} "
                         f"gives {coefficients} coefficients per token, more than hidden_size {config.hidden_size}: "
                         f"use fewer taps or larger groups")


def _config_json(config) -> tuple[dict, dict]:
    """vLLM reads the fields from ``dflash_config``; no AutoModel class (DFlash's file)."""
    return {}, {**{name: int(getattr(config, name)) for name in DFLASH2_FIELDS}, **FIXED}


def _read_config(data, dflash, source: str) -> dict:
    for name, value in FIXED.items():
        if dflash.get(name) is not None and float(dflash[name]) != value:
            raise ValueError(f"{source}: dflash_config.{name} {dflash[name]}: the project drafts DFlash2 "
                             f"with {value} only")
    for name in DFLASH2_FIELDS:
        if dflash.get(name) is None:
            raise ValueError(f"{source}: field dflash_config.{name} missing")
    return {name: int(dflash[name]) for name in DFLASH2_FIELDS}


FAMILY = DrafterFamily(name="dflash2", module=DFlash2Drafter, architecture=ARCHITECTURE, serving_method="dflash",
                       config_fields=DFLASH2_FIELDS, validate=_validate, config_bounds=BOUNDS,
                       config_json=_config_json, read_config=_read_config)
