"""Training checkpoints in object storage, written atomically, the last K kept.

Layout under the checkpoint prefix::

    step-00000040/model.safetensors   trainable drafter weights (no frozen target embeddings/head)
    step-00000040/trainer.pt          optimiser, scheduler, sampler, RNG states, step, run info
    latest.json                       {"step": 40, "dir": "step-00000040", "files": {name: sha256}}

All files of a checkpoint are written first; ``latest.json`` is written last and names them with
their checksums, so a crash mid-save leaves the previous checkpoint as the latest. Older step
directories beyond ``keep`` are deleted after the pointer moved.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import random
import re

import numpy as np
import torch
from dfp_shared.storage import NotFound, ObjectStore
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

log = logging.getLogger(__name__)

LATEST = "latest.json"
_STEP_DIR = re.compile(r"^step-(\d{8})/")


class CheckpointError(RuntimeError):
    """A checkpoint is missing a file or its checksum does not match ``latest.json``."""


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": _numpy_state_to_torch(np.random.get_state())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    np.random.set_state(_numpy_state_from_torch(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_state_to_torch(st) -> dict:
    return {"name": st[0], "keys": torch.from_numpy(st[1].astype(np.int64)), "pos": int(st[2]),
            "has_gauss": int(st[3]), "cached": float(st[4])}


def _numpy_state_from_torch(d: dict):
    return (d["name"], d["keys"].numpy().astype(np.uint32), d["pos"], d["has_gauss"], d["cached"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters that train plus buffers; frozen parameters (target embeddings, LM head) are left out."""
    out = {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}
    out.update({n: b.detach().contiguous() for n, b in model.named_buffers() if b is not None})
    return out


class CheckpointManager:
    """Save and load checkpoints under one prefix of an object store."""

    def __init__(self, store: ObjectStore, keep: int = 3):
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.store = store
        self.keep = keep

    def latest(self) -> dict | None:
        """The ``latest.json`` pointer, or None when no checkpoint exists."""
        try:
            return json.loads(self.store.get(LATEST))
        except NotFound:
            return None

    def save(self, step: int, model: torch.nn.Module, trainer_state: dict) -> str:
        """Write one checkpoint, then move ``latest.json`` to it, then prune. Returns its directory URI."""
        name = f"step-{step:08d}"
        weights = st_save({k: v.cpu() for k, v in trainable_state(model).items()}, metadata={"step": str(step)})
        buf = io.BytesIO()
        torch.save({**trainer_state, "step": step}, buf)
        files = {"model.safetensors": weights, "trainer.pt": buf.getvalue()}
        self.store.put_many([(f"{name}/{fname}", data) for fname, data in files.items()])
        pointer = {"step": step, "dir": name, "files": {f: hashlib.sha256(d).hexdigest() for f, d in files.items()}}
        self.store.put(LATEST, json.dumps(pointer, indent=1).encode())
        self._prune()
        log.info("checkpoint saved", extra={"step": step, "checkpoint": self.store.url(name)})
        return self.store.url(name)

    def load(self, model: torch.nn.Module, pointer: dict | None = None) -> dict:
        """Load the latest (or given) checkpoint's weights into ``model``; returns the trainer state."""
        pointer = pointer or self.latest()
        if pointer is None:
            raise CheckpointError(f"no checkpoint under {self.store.uri}")
        name = pointer["dir"]
        blobs = {}
        for fname, digest in pointer["files"].items():
            try:
                data = self.store.get(f"{name}/{fname}")
            except NotFound:
                raise CheckpointError(f"{self.store.url(name + '/' + fname)}: missing (named by {LATEST})") from None
            if hashlib.sha256(data).hexdigest() != digest:
                raise CheckpointError(f"{self.store.url(name + '/' + fname)}: checksum differs from {LATEST}")
            blobs[fname] = data
        weights = st_load(blobs["model.safetensors"])
        expected = trainable_state(model)
        missing = sorted(set(expected) - set(weights))
        unexpected = sorted(set(weights) - set(expected))
        if missing or unexpected:
            raise CheckpointError(f"{self.store.url(name)}: weights do not match the model "
                                  f"(missing {missing[:5]}, unexpected {unexpected[:5]}); was it trained with other settings?")
        with torch.no_grad():
            params = dict(model.named_parameters())
            params.update(dict(model.named_buffers()))
            for k, v in weights.items():
                params[k].copy_(v)
        state = torch.load(io.BytesIO(blobs["trainer.pt"]), map_location="cpu", weights_only=False)
        log.info("checkpoint loaded", extra={"step": state.get("step"), "checkpoint": self.store.url(name)})
        return state

    def steps(self) -> list[int]:
        return sorted({int(m.group(1)) for k in self.store.list("step-") if (m := _STEP_DIR.match(k))})

    def _prune(self) -> None:
        steps = self.steps()
        for step in steps[: max(0, len(steps) - self.keep)]:
            for key in list(self.store.list(f"step-{step:08d}/")):
                self.store.delete(key)
