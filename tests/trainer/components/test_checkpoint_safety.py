"""Checkpoints hold data only: nothing read back from storage is unpickled.

Whoever can write a job's output prefix controls its checkpoint files and the checksums in
``latest.json`` beside them, so the checksums prove nothing about who wrote a file. A planted
pickle must never run; the old pickled ``trainer.pt`` format is refused by name.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import random

import numpy as np
import pytest
import torch
from dfp_shared.specs.train import TrainSpec
from dfp_shared.storage.store import open_store
from dfp_trainer.components.checkpoint import CheckpointError, CheckpointManager, rng_state, set_rng_state
from dfp_trainer.components.distributed import DistInfo
from dfp_trainer.loop.prepare import TrainError
from dfp_trainer.run import train

from tests.trainer.train_support import run_config, tiny_spec, torch_threads


class _Planted:
    """Unpickling this creates ``path`` (stands in for any shell command the worker's user may run)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _plant_pickle(store, marker) -> None:
    """Replace the latest checkpoint's trainer state by a pickle, with a correct checksum in ``latest.json``."""
    pointer = json.loads(store.get("latest.json"))
    buf = io.BytesIO()
    torch.save({"step": pointer["step"], "payload": _Planted(marker)}, buf)
    evil = buf.getvalue()
    store.put(f"{pointer['dir']}/trainer.pt", evil)
    files = {"model.safetensors": pointer["files"]["model.safetensors"], "trainer.pt": hashlib.sha256(evil).hexdigest()}
    store.put("latest.json", json.dumps({**pointer, "files": files}).encode())


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def test_planted_pickle_is_refused_and_never_runs(tmp_path):
    store = open_store(f"file://{tmp_path}/ck")
    mgr = CheckpointManager(store)
    model = torch.nn.Linear(3, 2)
    mgr.save(4, model, {"sampler": {"epoch": 0, "position": 4}})
    marker = tmp_path / "pwned"
    _plant_pickle(store, marker)

    with pytest.raises(CheckpointError, match=r"trainer\.pt.*(old|pickle)"):
        mgr.load(torch.nn.Linear(3, 2))
    assert not marker.exists()


def test_a_checkpoint_of_other_tensor_shapes_is_refused_by_name(tmp_path):
    """Resuming with another rank or width: refused naming the tensor, never broadcast into the model."""
    store = open_store(f"file://{tmp_path}/ck")
    mgr = CheckpointManager(store)
    mgr.save(4, torch.nn.Linear(3, 1), {"sampler": {"epoch": 0, "position": 4}})
    with pytest.raises(CheckpointError, match=r"shapes differ.*weight \(1, 3\) vs \(2, 3\)"):
        mgr.load(torch.nn.Linear(3, 2))  # a (1, 3) weight would broadcast into (2, 3)


def test_stray_pickle_beside_a_checkpoint_is_ignored(tmp_path):
    store = open_store(f"file://{tmp_path}/ck")
    mgr = CheckpointManager(store)
    model = torch.nn.Linear(3, 2)
    mgr.save(4, model, {"sampler": {"epoch": 0, "position": 4}})
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(_Planted(marker), buf)
    store.put(f"{mgr.latest()['dir']}/trainer.pt", buf.getvalue())

    state = mgr.load(torch.nn.Linear(3, 2))
    assert state["step"] == 4 and state["sampler"] == {"epoch": 0, "position": 4}
    assert not marker.exists()


def test_resume_from_a_planted_pickle_fails_clearly(tmp_path, tiny_qwen3_dir, tiny_dataset):
    out = f"file://{tmp_path}/run"
    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, out, steps=2, checkpoint_every=2)
    assert train(run_config(spec), DistInfo()).completed
    marker = tmp_path / "pwned"
    _plant_pickle(open_store(out + "/checkpoints"), marker)

    again = TrainSpec.model_validate({**spec, "steps": 4})
    with pytest.raises((CheckpointError, TrainError), match=r"trainer\.pt"):
        train(run_config(again), DistInfo())
    assert not marker.exists()


def test_checkpoint_files_hold_tensors_and_json_only(tmp_path):
    store = open_store(f"file://{tmp_path}/ck")
    CheckpointManager(store).save(3, torch.nn.Linear(3, 2), {"sampler": {"epoch": 1, "position": 3}})
    pointer = json.loads(store.get("latest.json"))
    assert set(pointer["files"]) == {"model.safetensors", "trainer.json", "trainer.safetensors"}
    assert sorted(store.list("step-")) == sorted(f"step-00000003/{f}" for f in pointer["files"])
    skeleton = json.loads(store.get("step-00000003/trainer.json"))
    assert skeleton["state"]["sampler"] == {"epoch": 1, "position": 3}


def _train_steps(model: torch.nn.Module, optim, sched, steps: int) -> None:
    for i in range(steps):
        model(torch.full((4, 3), float(i))).square().sum().backward()
        optim.step()
        optim.zero_grad()
        sched.step()


def test_trainer_state_round_trips_exactly(tmp_path):
    """Optimiser (int keys, tuples, tensor steps), scheduler, RNG states and odd floats come back as they were,
    and a resumed optimiser and RNG continue exactly like the original ones."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 0.5 ** s)
    _train_steps(model, optim, sched, 3)
    random.random()
    np.random.rand()
    state = {"optimizer": optim.state_dict(), "scheduler": sched.state_dict(), "rng": rng_state(),
             "history": [{"step": 1, "loss": 0.1 + 0.2, "nan": float("nan"), "inf": -math.inf}],
             "odd": {"__tensor__": "not a tensor", 7: (1, [2, (3,)]), "": None}, "world_size": 1}
    store = open_store(f"file://{tmp_path}/ck")
    mgr = CheckpointManager(store)
    mgr.save(3, model, state)

    expected_next = (torch.rand(3), random.random(), np.random.rand())
    fresh = torch.nn.Linear(3, 2)
    got = mgr.load(fresh)
    assert got["step"] == 3 and got["world_size"] == 1
    assert got["odd"] == {"__tensor__": "not a tensor", 7: (1, [2, (3,)]), "": None}
    assert got["history"][0]["loss"] == 0.1 + 0.2 and math.isnan(got["history"][0]["nan"])
    assert got["history"][0]["inf"] == -math.inf
    assert got["scheduler"] == sched.state_dict()
    assert got["optimizer"]["param_groups"] == optim.state_dict()["param_groups"]
    for idx, per_param in optim.state_dict()["state"].items():
        for key, value in per_param.items():
            assert torch.equal(got["optimizer"]["state"][idx][key], value)
            assert got["optimizer"]["state"][idx][key].dtype == value.dtype

    set_rng_state(got["rng"])
    assert torch.equal(torch.rand(3), expected_next[0])
    assert random.random() == expected_next[1] and np.random.rand() == expected_next[2]

    resumed = torch.optim.AdamW(fresh.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    resumed.load_state_dict(got["optimizer"])
    for m, o in ((model, optim), (fresh, resumed)):
        m(torch.ones(4, 3)).square().sum().backward()
        o.step()
    assert torch.equal(model.weight, fresh.weight) and torch.equal(model.bias, fresh.bias)


def _rewrite(store, fname: str, data: bytes) -> None:
    """Replace one file of the latest checkpoint, with a matching checksum (as anyone with write access can)."""
    pointer = json.loads(store.get("latest.json"))
    store.put(f"{pointer['dir']}/{fname}", data)
    pointer["files"][fname] = hashlib.sha256(data).hexdigest()
    store.put("latest.json", json.dumps(pointer).encode())


@pytest.mark.parametrize(("skeleton", "reason"), [
    (b"{not json", r"trainer\.json.*not valid JSON"),
    (b"[1, 2]", r"trainer\.json.*format"),
    (b'{"format": "dfp-trainer-state/1", "state": {"x": {"__tensor__": "missing"}}}', r"missing.*trainer\.safetensors"),
    (b'{"format": "dfp-trainer-state/1", "state": {"x": {"__call__": ["os.system", "id"]}}}', r"__call__"),
    (b'{"format": "dfp-trainer-state/1", "state": [1]}', r"state.*object"),
    (b'{"format": "dfp-trainer-state/1", "state": ' + b'[' * 5000 + b']' * 5000 + b'}', r"trainer\.json"),
])
def test_malformed_trainer_state_is_a_clear_error(tmp_path, skeleton, reason):
    store = open_store(f"file://{tmp_path}/ck")
    mgr = CheckpointManager(store)
    mgr.save(2, torch.nn.Linear(3, 2), {"sampler": {"epoch": 0, "position": 2}})
    _rewrite(store, "trainer.json", skeleton)
    with pytest.raises(CheckpointError, match=reason):
        mgr.load(torch.nn.Linear(3, 2))


@pytest.mark.parametrize("pointer", [
    {"step": 2, "dir": "../elsewhere", "files": {"model.safetensors": "0"}},
    {"step": 2, "dir": "step-00000002", "files": {"../../latest.json": "0"}},
    {"step": 2, "dir": "step-00000002", "files": {"model.safetensors": "0", "trainer.json": "0"}},
    {"step": "2", "dir": "step-00000002"},
    [],
])
def test_pointer_names_only_the_checkpoint_files(tmp_path, pointer):
    store = open_store(f"file://{tmp_path}/ck")
    mgr = CheckpointManager(store)
    mgr.save(2, torch.nn.Linear(3, 2), {"sampler": {"epoch": 0, "position": 2}})
    store.put("latest.json", json.dumps(pointer).encode())
    with pytest.raises(CheckpointError, match=r"latest\.json"):
        mgr.load(torch.nn.Linear(3, 2))


def test_unreadable_pointer_is_a_clear_error(tmp_path):
    store = open_store(f"file://{tmp_path}/ck")
    store.put("latest.json", b"\xff{")
    with pytest.raises(CheckpointError, match=r"latest\.json"):
        CheckpointManager(store).latest()
