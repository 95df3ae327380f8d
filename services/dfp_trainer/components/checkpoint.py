"""Training checkpoints in object storage, written atomically, the last K kept.

Layout under the checkpoint prefix::

    step-00000040/model.safetensors    trainable drafter weights (no frozen target embeddings/head)
    step-00000040/trainer.json         optimiser, scheduler, sampler, RNG states, step, run info (JSON)
    step-00000040/trainer.safetensors  the tensors trainer.json names (optimiser moments, RNG states)
    latest.json                        {"step": 40, "dir": "step-00000040", "files": {name: sha256}}

All files of a checkpoint are written first; ``latest.json`` is written last and names them with
their checksums, so a crash mid-save leaves the previous checkpoint as the latest. Older step
directories beyond ``keep`` are deleted after the pointer moved.

Nothing is unpickled on loading (see :mod:`.state_codec`): whoever can write the prefix can write
the checksums too, so they guard against torn writes, not against planted files. ``latest.json``
must name exactly the files above in the directory of its step; a checkpoint of the earlier
format (a pickled ``trainer.pt``) is refused, never read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re

import numpy as np
import torch
from dfp_shared.storage.store import NotFound, ObjectStore
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .state_codec import StateFormatError, decode, encode

log = logging.getLogger(__name__)

LATEST = "latest.json"
FILES = ("model.safetensors", "trainer.json", "trainer.safetensors")
LEGACY_STATE = "trainer.pt"  # pickled trainer state of the earlier format: refused
_STEP_DIR = re.compile(r"^step-(\d{8})/")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing a file, a checksum does not match ``latest.json``, or a file is not
    what the format says (the message names the file and the reason)."""


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
            data = self.store.get(LATEST)
        except NotFound:
            return None
        try:
            return json.loads(data)
        except RecursionError:
            raise CheckpointError(f"{self.store.url(LATEST)}: nested too deep") from None
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise CheckpointError(f"{self.store.url(LATEST)}: not valid JSON ({exc})") from None

    def save(self, step: int, model: torch.nn.Module, trainer_state: dict) -> str:
        """Write one checkpoint, then move ``latest.json`` to it, then prune. Returns its directory URI."""
        name = f"step-{step:08d}"
        weights = st_save({k: v.cpu() for k, v in trainable_state(model).items()}, metadata={"step": str(step)})
        skeleton, tensors = encode({**trainer_state, "step": step})
        files = {"model.safetensors": weights, "trainer.json": skeleton, "trainer.safetensors": tensors}
        self.store.put_many([(f"{name}/{fname}", data) for fname, data in files.items()])
        pointer = {"step": step, "dir": name, "files": {f: hashlib.sha256(d).hexdigest() for f, d in files.items()}}
        self.store.put(LATEST, json.dumps(pointer, indent=1).encode())
        self._prune()
        log.info("checkpoint saved", extra={"step": step, "checkpoint": self.store.url(name)})
        return self.store.url(name)

    def load(self, model: torch.nn.Module, pointer: dict | None = None) -> dict:
        """Load the latest (or given) checkpoint's weights into ``model``; returns the trainer state."""
        pointer = pointer if pointer is not None else self.latest()
        if pointer is None:
            raise CheckpointError(f"no checkpoint under {self.store.uri}")
        name, files = self._check_pointer(pointer)
        blobs = {}
        for fname, digest in files.items():
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
        if "d2t" in weights and not torch.equal(weights["d2t"], expected["d2t"].cpu()):
            raise CheckpointError(f"{self.store.url(name)}: its draft vocabulary differs from the one this run chose "
                                  "from its dataset (another dataset or draft_vocab_size?)")
        with torch.no_grad():
            params = dict(model.named_parameters())
            params.update(dict(model.named_buffers()))
            differ = [f"{k} {tuple(v.shape)} vs {tuple(params[k].shape)}" for k, v in weights.items()
                      if v.shape != params[k].shape]
            if differ:
                raise CheckpointError(f"{self.store.url(name)}: tensor shapes differ from this run's model "
                                      f"({', '.join(differ[:3])}); was it trained with other settings (a rank, "
                                      f"layer sizes)?")
            for k, v in weights.items():
                params[k].copy_(v)
        try:
            state = decode(blobs["trainer.json"], blobs["trainer.safetensors"])
        except StateFormatError as exc:
            raise CheckpointError(f"{self.store.url(name)}/{exc}") from None
        log.info("checkpoint loaded", extra={"step": state.get("step"), "checkpoint": self.store.url(name)})
        return state

    def _check_pointer(self, pointer) -> tuple[str, dict[str, str]]:
        """The step directory and ``{file: sha256}`` of a pointer that names exactly this format's files."""
        where = self.store.url(LATEST)
        if not isinstance(pointer, dict):
            raise CheckpointError(f"{where}: must be an object with step, dir and files")
        step, name, files = pointer.get("step"), pointer.get("dir"), pointer.get("files")
        if type(step) is not int or not 0 <= step <= 99_999_999:
            raise CheckpointError(f"{where}: step must be an integer 0..99999999 (got {step!r})")
        if name != f"step-{step:08d}":
            raise CheckpointError(f"{where}: dir must be 'step-{step:08d}' for step {step} (got {name!r})")
        if not isinstance(files, dict):
            raise CheckpointError(f"{where}: files must map file names to sha256 digests")
        if LEGACY_STATE in files:
            raise CheckpointError(
                f"{self.store.url(name + '/' + LEGACY_STATE)}: checkpoint in the old pickled format (trainer.pt); it is "
                f"not loaded, since unpickling can run code. Start over: remove {self.store.uri}, use a new output "
                "prefix, or train without resume")
        if set(files) != set(FILES) or not all(isinstance(d, str) and _SHA256.match(d) for d in files.values()):
            raise CheckpointError(f"{where}: files must name exactly {list(FILES)} with their sha256 digests "
                                  f"(got {sorted(map(str, files))[:5]})")
        return name, files

    def steps(self) -> list[int]:
        return sorted({int(m.group(1)) for k in self.store.list("step-") if (m := _STEP_DIR.match(k))})

    def _prune(self) -> None:
        steps = self.steps()
        for step in steps[: max(0, len(steps) - self.keep)]:
            for key in list(self.store.list(f"step-{step:08d}/")):
                self.store.delete(key)
