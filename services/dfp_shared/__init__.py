"""Shared core of dflash-pipeline, in rooms by domain: ``storage`` (stores, roots, ownership), ``jobs`` (job
records, job types, the queue, the worker loop), ``models`` (targets, tokenizers, GGUF import), ``records`` (prompt
sets, completion records, token shards, the capture layout), ``hidden_states``, ``chat_template``, ``specs`` and
``record_sources``; at the top, what every service needs (config, settings flags, logs, metrics, signals, the API's
client, the HTTP front door, printable text)."""

from __future__ import annotations

import importlib


def public_face(package: str, names: dict[str, list[str]]):
    """A room's public face: its main names, each imported from its module on first use (so a room's light
    modules never pull in a heavy sibling's imports). Returns the package's ``__getattr__`` and ``__all__``."""
    where = {name: module for module, listed in names.items() for name in listed}

    def __getattr__(name: str):
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__, sorted(where)
