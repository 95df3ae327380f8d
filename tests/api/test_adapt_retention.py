"""A run's prefix holds copies of captured traffic (the window's records, held-out prompts, regenerated answers,
their tokens): the next run deletes every run of its drafter older than the retention, so no copy of the traffic
outlives the capture's own retention by more than the schedule's interval."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from dfp_adapt.run import sweep_old_runs
from dfp_adapt.settings import AdaptSettings
from dfp_shared.storage.store import open_store

NOW = datetime(2026, 3, 8, 3, 0, tzinfo=timezone.utc)


def make_run(store, name: str, stamp: str, owner: str = "adapt") -> None:
    for key in ("data/greedy.jsonl", "heldout.jsonl", "tokens/shard-00000.safetensors"):
        store.put(f"{name}/{stamp}/{key}", b"x")
    store.put(f"{name}/{stamp}/.dflash-owner.json", json.dumps({"owner": owner, "job_id": "adapt-x"}).encode())


def test_runs_older_than_the_retention_are_deleted_whole_and_the_rest_kept(tmp_path):
    runs = f"file://{tmp_path}/adapt"
    store = open_store(runs)
    old, edge, recent = (NOW - timedelta(hours=h) for h in (200, 167, 1))
    for when in (old, edge, recent):
        make_run(store, "qwen3", f"{when:%Y%m%dT%H%M%S}")
    make_run(store, "other", f"{old:%Y%m%dT%H%M%S}")  # another drafter's runs are its own loop's to sweep
    store.put("qwen3/notes.txt", b"not a run")  # nothing the loop did not name is touched
    store.put("qwen3/20260101T000000x/keep.txt", b"not a run stamp")
    store.put("qwen3/20261399T000000/keep.txt", b"a stamp's shape, no date")  # skipped, not a stop
    make_run(store, "qwen3", "20260101T000000", owner="mallory")  # another principal's output: not the loop's
    store.put("qwen3/20260102T000000/keep.txt", b"no owner marker")

    swept = sweep_old_runs(f"{runs}/qwen3/", retention_hours=168, now=NOW, owner="adapt")

    assert swept == [f"{old:%Y%m%dT%H%M%S}"]
    left = set(store.list(""))
    assert not any(k.startswith(f"qwen3/{old:%Y%m%dT%H%M%S}/") for k in left)
    assert not store.exists(f"qwen3/{old:%Y%m%dT%H%M%S}/.dflash-owner.json")
    for when in (edge, recent):
        assert f"qwen3/{when:%Y%m%dT%H%M%S}/data/greedy.jsonl" in left
    assert f"other/{old:%Y%m%dT%H%M%S}/heldout.jsonl" in left
    assert {"qwen3/notes.txt", "qwen3/20260101T000000x/keep.txt", "qwen3/20261399T000000/keep.txt",
            "qwen3/20260101T000000/heldout.jsonl", "qwen3/20260102T000000/keep.txt"} <= left


def test_the_retention_defaults_to_the_capture_s_and_is_bounded(monkeypatch):
    assert AdaptSettings().adapt_retention_hours == 168
    monkeypatch.setenv("DFLASH_ADAPT_RETENTION_HOURS", "0")
    with pytest.raises(ValueError, match="adapt_retention_hours"):
        AdaptSettings()
