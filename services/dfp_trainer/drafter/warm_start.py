"""A drafter started from an existing one (train spec ``init_from``): the project's own export or a drafter as
published, in the z-lab layout (``config.json`` with ``dflash_config``) or vLLM speculators' layout
(``speculators_model_type: dflash``, the draft layers' config as ``transformer_layer_config``).

The run's drafter is built from its spec first; the stored drafter must then be that very drafter:

- **config**: read from either layout (a speculators file's ``aux_hidden_state_layer_ids`` are the target layer
  ids plus one) into a :class:`~.config.DrafterConfig` by :func:`~.stored.read_drafter_config`, which bounds
  every sizing field on the file's dict before anything is built from it; then every field is compared with
  the run's: family, hidden size, vocabulary, target layer count, widths and heads, draft layers, target layer
  ids, mask token id, block size, layer types and window, the pruned vocabulary's size, RoPE and the family's
  own fields. A difference is refused naming the field, the file's value and the run's.
- **weights**: ``model.safetensors`` only (no pickle, no code: ``auto_map`` and modeling files are never read).
  Its tensor names and shapes are checked from the header before a byte is loaded: every trainable tensor of
  the run's drafter must be there with its shape, nothing else but the frozen ones. Frozen tensors (a pruned
  vocabulary's ``lm_head.weight`` and ``d2t``; the target's ``embed_tokens.weight`` and full ``lm_head.weight``,
  or a ``t2d`` mask, which published drafters may carry) are not taken from the file: when present they must
  equal the run's, so a drafter pruned to another vocabulary is refused.

Then the trainable tensors are copied in; the optimiser starts fresh at step 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import DrafterConfig
from .stored import SPECULATORS, ZLAB, read_drafter_config

MISSING = "missing from the drafter to start from"
# compared first, so that a drafter of another family or another target is refused by what differs most
FIRST = ("family", "hidden_size", "vocab_size", "num_target_layers")
NOT_COMPARED = ("max_position_embeddings",)  # the run's own target decides how far positions go
# tensors a stored drafter may carry that are the target's (never trained): equal to the target's when present
TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight", "t2d")


@dataclass
class WarmStart:
    """What :func:`warm_start` did (recorded in the run report)."""

    layout: str  # ``zlab`` or ``speculators``
    family: str
    loaded: list[str]  # the drafter's tensors set from the file
    checked: list[str]  # the file's frozen tensors found equal to the run's

    def record(self, uri: str) -> dict[str, Any]:
        return {"uri": uri, "layout": self.layout, "family": self.family, "tensors": len(self.loaded),
                "frozen_checked": self.checked}


def read_stored_config(directory: str | os.PathLike, num_target_layers: int) -> tuple[DrafterConfig, str]:
    """The stored drafter's config and its layout (:func:`~.stored.read_drafter_config`, either layout);
    ValueError (naming the file and the field) when it is none. ``num_target_layers``: the run's, for a
    speculators file that does not state it."""
    return read_drafter_config(directory, MISSING, (ZLAB, SPECULATORS), num_target_layers)


def check_same_drafter(stored: DrafterConfig, run: DrafterConfig, source: str) -> None:
    """Every field of the stored drafter's config is the run's; ValueError naming the first that differs."""
    names = [*FIRST, *(f.name for f in fields(DrafterConfig) if f.name not in FIRST + NOT_COMPARED)]
    for name in names:
        mine, theirs = getattr(stored, name), getattr(run, name)
        if mine != theirs:
            raise ValueError(f"{source}: {name} is {mine!r} in the drafter to start from, but {theirs!r} in this run"
                             + _hint(name))


def _hint(name: str) -> str:
    if name in ("hidden_size", "vocab_size", "num_target_layers"):
        return " (it was trained for another target)"
    if name == "draft_vocab_size":
        return " (set draft_vocab_size to the drafter's)"
    return ""


def _header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: (tuple(handle.get_slice(name).get_shape()), handle.get_slice(name).get_dtype())
                    for name in handle.keys()}
    except Exception as exc:  # noqa: BLE001 - a header safetensors cannot read: not a drafter's weights
        raise ValueError(f"{path}: not a safetensors file a drafter can be loaded from ({exc})") from None


def _expected(drafter: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(trainable, frozen) tensors of the run's drafter by state_dict name; frozen: what a file may hold but the
    run never takes from it (the pruned head, ``d2t``, the target's embedding and LM head)."""
    state = drafter.state_dict()
    trainable_names = {name for name, p in drafter.named_parameters() if p.requires_grad}
    trainable = {n: t for n, t in state.items() if n in trainable_names}
    frozen = {n: t for n, t in state.items() if n not in trainable_names}
    embed, head = drafter._target
    frozen.setdefault("embed_tokens.weight", embed.weight)
    frozen.setdefault("lm_head.weight", head.weight)
    return trainable, frozen


def check_tensor_names(path: Path, header: dict, trainable: dict, frozen: dict) -> None:
    """The file holds every trainable tensor at its shape and nothing but them and frozen ones; ValueError."""
    missing = sorted(set(trainable) - set(header))
    allowed = set(trainable) | set(frozen) | {"t2d"}
    unexpected = sorted(set(header) - allowed)
    if missing or unexpected:
        raise ValueError(f"{path}: tensors do not match this run's drafter: missing {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{' ...' if len(unexpected) > 5 else ''}")
    for name, (shape, _dtype) in header.items():
        want = tuple(trainable[name].shape) if name in trainable else \
            (tuple(frozen[name].shape) if name in frozen else (frozen["embed_tokens.weight"].shape[0],))
        if shape != want:
            raise ValueError(f"{path}: tensor {name} has shape {shape}, this run's drafter {want}")


def _check_frozen(path: Path, name: str, stored: torch.Tensor, frozen: dict, drafter: nn.Module) -> None:
    if name == "t2d":
        run = torch.zeros(frozen["embed_tokens.weight"].shape[0], dtype=torch.bool)
        d2t = getattr(drafter, "d2t", None)
        if d2t is None:
            run[:] = True
        else:
            run[d2t.cpu().long() + torch.arange(d2t.numel())] = True
        same = torch.equal(stored.bool(), run)
    else:
        run = frozen[name].detach().cpu()
        same = run.shape == stored.shape and torch.equal(run.to(stored.dtype), stored)
    if not same:
        what = "the draft vocabulary differs from this run's" if name in ("d2t", "t2d") or (
            name == "lm_head.weight" and hasattr(drafter, "d2t")) else "it is not this run's target's"
        raise ValueError(f"{path}: tensor {name}: {what}")


@torch.no_grad()
def warm_start(drafter: nn.Module, directory: str | os.PathLike) -> WarmStart:
    """Set ``drafter``'s trainable tensors from the stored drafter in ``directory`` (either layout) after checking
    that it is this run's drafter (module docstring); ValueError naming what differs, FileNotFoundError when a
    file is missing."""
    from safetensors import safe_open

    directory = Path(directory)
    stored, layout = read_stored_config(directory, drafter.config.num_target_layers)
    check_same_drafter(stored, drafter.config, str(directory / "config.json"))
    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: {MISSING}")
    header = _header(weights)
    trainable, frozen = _expected(drafter)
    check_tensor_names(weights, header, trainable, frozen)
    params = dict(drafter.named_parameters())
    checked = []
    with safe_open(str(weights), framework="pt") as handle:
        for name in sorted(n for n in header if n not in trainable):
            _check_frozen(weights, name, handle.get_tensor(name), frozen, drafter)
            checked.append(name)
        for name in sorted(trainable):
            tensor = handle.get_tensor(name)
            if not tensor.is_floating_point():
                raise ValueError(f"{weights}: tensor {name} is {tensor.dtype}, not floating point")
            params[name].copy_(tensor)
    return WarmStart(layout, stored.family, sorted(trainable), checked)
