"""The drafter family registry: one :class:`DrafterFamily` per family says everything the trainer, the export and
the serving commands need to know of it (torchtitan's one spec per model). The families themselves live in
:mod:`.families`, one folder each, and register there; :class:`~.config.DrafterConfig` stores its family's name and
asks the registry for the rest.

This module is part of the shared backbone: it imports no family (a family imports it to register)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

DrafterConfig = Any  # :class:`~.config.DrafterConfig`, which imports this module (annotations only)


def _nothing(*_args: Any) -> dict:
    return {}


@dataclass(frozen=True)
class DrafterFamily:
    """A drafter family: its module, its config fields and their checks, its ``config.json`` and how it is served."""

    name: str  # DrafterConfig.family and the train spec's `family`
    module: Callable[..., Any]  # the drafter class: (config, embed_tokens, lm_head, draft_ids) -> DFlashDrafter
    architecture: str  # config.json `architectures`: how an exported drafter is told to be of this family
    serving_method: str  # vLLM's speculative method
    config_fields: tuple[str, ...] = ()  # DrafterConfig fields only this family sets (others keep their default)
    # the family's own checks of a config (ValueError), after the backbone's
    validate: Callable[[DrafterConfig], None] = _nothing
    # config.json fields beyond DFlash's: (top-level fields, written after dflash_config; dflash_config fields)
    config_json: Callable[[DrafterConfig], tuple[dict, dict]] = lambda config: ({}, {})
    # the family's own config.json fields bounded on the raw file before anything is read from them (see
    # :func:`~.bounds.check_config_dict`): (field, low, high), a field of dflash_config named ``dflash_config.<name>``
    config_bounds: tuple[tuple[str, int, int], ...] = ()
    # DrafterConfig fields of this family read back from config.json (data, its dflash_config, source); ValueError
    read_config: Callable[[Mapping[str, Any], Mapping[str, Any], str], dict] = _nothing
    # DFlash's reference route: the export ships modeling_dflash.py with auto_map (transformers' AutoModel), SGLang
    # and vLLM's V1 runner serve it; else vLLM's own class, served by its V2 model runner only
    reference_route: bool = False


FAMILIES: dict[str, DrafterFamily] = {}
"""The registered families by name, in registration order (:mod:`.families` registers the project's)."""


def register(family: DrafterFamily) -> DrafterFamily:
    """Add a family to the registry (a family's name and architecture are its own)."""
    taken = [f.name for f in FAMILIES.values() if family.architecture == f.architecture and family.name != f.name]
    if taken:
        raise ValueError(f"architecture {family.architecture} is already family {taken[0]!r}'s")
    FAMILIES[family.name] = family
    return family


def family(name: str) -> DrafterFamily:
    """The registered family ``name``."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown drafter family {name!r}; registered: {', '.join(FAMILIES)}") from None


def family_of_fields(config: DrafterConfig) -> str:
    """The family of a config built without one (before configs stored it): the first registered family whose
    own fields are set, else ``dflash``."""
    for f in FAMILIES.values():
        if any(config.field_is_set(name) for name in f.config_fields):
            return f.name
    return "dflash"


def family_of_architectures(architectures: list[str], source: str) -> DrafterFamily:
    """The family an exported ``config.json`` names in ``architectures``."""
    for f in sorted(FAMILIES.values(), key=lambda f: f.reference_route):  # a family's own class before DFlash's
        if f.architecture in architectures:
            return f
    raise ValueError(f"{source}: architectures {architectures} names none of "
                     f"{', '.join(f.architecture for f in FAMILIES.values())}")
