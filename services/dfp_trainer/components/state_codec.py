"""Trainer state as data only: a JSON skeleton plus a safetensors file of its tensors.

Reading either back runs no code (no pickle), so a checkpoint written by someone else can at worst
hold wrong numbers. The skeleton is plain JSON where the state is (str-keyed dicts, lists, numbers,
strings, booleans, null; floats keep every bit, NaN and infinities included) and one-key objects
where it is not:

* ``{"__tensor__": "t3"}``: the tensor named ``t3`` in the safetensors file;
* ``{"__tuple__": [...]}``: a tuple (Python RNG state, betas);
* ``{"__dict__": [[key, value], ...]}``: a dict with a non-string key (optimiser state is keyed by
  parameter index) or a key starting with ``__``.

Any other key starting with ``__`` is refused on reading.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT = "dfp-trainer-state/1"
_TENSOR, _TUPLE, _DICT = "__tensor__", "__tuple__", "__dict__"


class StateFormatError(ValueError):
    """The skeleton or its tensors do not form a trainer state (the message names where)."""


def encode(state: dict) -> tuple[bytes, bytes]:
    """``(skeleton JSON, safetensors)`` of a trainer state."""
    tensors: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}  # id(tensor) -> name: one object stored once
    storages: set[int] = set()  # safetensors refuses two tensors over one memory

    def tensor(t: torch.Tensor) -> dict:
        if id(t) not in names:
            data = t.detach().cpu().contiguous()
            ptr = data.untyped_storage().data_ptr()
            if ptr and ptr in storages:
                data = data.clone()
            storages.add(data.untyped_storage().data_ptr())
            names[id(t)] = name = f"t{len(tensors)}"
            tensors[name] = data
        return {_TENSOR: names[id(t)]}

    def walk(value: Any, path: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, np.bool_):
            return bool(value)
        if isinstance(value, np.integer):
            return int(value)
        if isinstance(value, np.floating):
            return float(value)
        if isinstance(value, torch.Tensor):
            return tensor(value)
        if isinstance(value, tuple):
            return {_TUPLE: [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: walk(v, f"{path}.{k}") for k, v in value.items()}
            for k in value:
                if not (k is None or isinstance(k, (bool, int, float, str))):
                    raise TypeError(f"trainer state {path}: key {k!r} of type {type(k).__name__} cannot be stored")
            return {_DICT: [[k, walk(v, f"{path}.{k}")] for k, v in value.items()]}
        raise TypeError(f"trainer state {path}: a {type(value).__name__} cannot be stored (tensors and JSON values only)")

    skeleton = {"format": FORMAT, "state": walk(state, "state")}
    return json.dumps(skeleton, separators=(",", ":")).encode(), st_save(tensors)


def decode(skeleton: bytes, tensor_data: bytes) -> dict:
    """The trainer state back from :func:`encode`'s two files; :class:`StateFormatError` when they are not that."""
    try:
        doc = json.loads(skeleton)
    except RecursionError:
        raise StateFormatError("trainer.json: nested too deep") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise StateFormatError(f"trainer.json: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise StateFormatError(f"trainer.json: format is {found!r}, expected {FORMAT!r}")
    if not isinstance(doc.get("state"), dict):
        raise StateFormatError("trainer.json: state must be an object")
    try:
        tensors = st_load(tensor_data)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types on malformed input
        raise StateFormatError(f"trainer.safetensors: not a safetensors file ({exc})") from None
    used: set[str] = set()

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        special = [k for k in node if k.startswith("__")]
        if not special:
            return {k: walk(v, f"{path}.{k}") for k, v in node.items()}
        if len(node) != 1 or special[0] not in (_TENSOR, _TUPLE, _DICT):
            raise StateFormatError(f"trainer.json: {path}: unknown entry {special[0]!r}")
        (kind, body), = node.items()
        if kind == _TENSOR:
            if not isinstance(body, str) or body not in tensors:
                raise StateFormatError(f"trainer.json: {path}: tensor {body!r} is missing from trainer.safetensors")
            used.add(body)
            return tensors[body]
        if not isinstance(body, list):
            raise StateFormatError(f"trainer.json: {path}: {kind} must hold a list")
        if kind == _TUPLE:
            return tuple(walk(v, f"{path}[{i}]") for i, v in enumerate(body))
        out = {}
        for i, pair in enumerate(body):
            if not (isinstance(pair, list) and len(pair) == 2 and not isinstance(pair[0], (list, dict))):
                raise StateFormatError(f"trainer.json: {path}: entry {i} of {kind} must be [key, value]")
            out[pair[0]] = walk(pair[1], f"{path}.{pair[0]}")
        return out

    try:
        state = walk(doc["state"], "state")
    except RecursionError:
        raise StateFormatError("trainer.json: nested too deep") from None
    unused = sorted(set(tensors) - used)
    if unused:
        raise StateFormatError(f"trainer.safetensors: tensors {unused[:5]} are not named by trainer.json")
    return state
