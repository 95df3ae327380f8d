"""DSpark: the DFlash drafter plus a sequential Markov head and an optional confidence head (:mod:`.model`), as
vLLM's Qwen3 DSpark drafter serves it (``architectures: ["Qwen3DSparkModel"]``, method ``dspark``, its V2 runner;
the z-lab layout only, no modeling file: the class is vLLM's)."""

from __future__ import annotations

from dfp_shared.specs.train import MAX_MARKOV_RANK

from ...family import DrafterFamily
from .model import DSparkDrafter

ARCHITECTURE = "Qwen3DSparkModel"  # vLLM's Qwen3 DSpark drafter (served as method ``dspark``)


def _validate(config) -> None:
    if config.markov_rank is None:
        raise ValueError("a confidence head is a DSpark drafter's: set markov_rank" if config.confidence_head
                         else "a DSpark drafter needs markov_rank")
    if not 1 <= int(config.markov_rank) <= MAX_MARKOV_RANK:
        raise ValueError(f"markov_rank must be 1..{MAX_MARKOV_RANK}, got {config.markov_rank}")


def _config_json(config) -> tuple[dict, dict]:
    """The ``config.json`` fields vLLM's Qwen3 DSpark drafter reads beyond DFlash's: the Markov rank, the
    confidence head (fed the hidden state only), and ``sample_from_anchor: false``: the DFlash block (anchor,
    then masks that predict their own positions), as trained here. No ``auto_map``: the modeling file is
    DFlash's."""
    return {"markov_rank": config.markov_rank, "enable_confidence_head": config.confidence_head,
            "confidence_head_with_markov": False, "sample_from_anchor": False}, {}


def _read_config(data, dflash, source: str) -> dict:
    if data.get("sample_from_anchor", True) or data.get("confidence_head_with_markov"):
        raise ValueError(f"{source}: a DSpark drafter here drafts from the DFlash block with a confidence head of "
                         f"the hidden state (sample_from_anchor and confidence_head_with_markov false)")
    if data.get("markov_rank") is None:
        raise ValueError(f"{source}: field 'markov_rank' missing")
    return {"markov_rank": int(data["markov_rank"]), "confidence_head": bool(data.get("enable_confidence_head", False))}


FAMILY = DrafterFamily(name="dspark", module=DSparkDrafter, architecture=ARCHITECTURE, serving_method="dspark",
                       config_fields=("markov_rank", "confidence_head"), validate=_validate,
                       config_bounds=(("markov_rank", 1, MAX_MARKOV_RANK),), config_json=_config_json,
                       read_config=_read_config)
