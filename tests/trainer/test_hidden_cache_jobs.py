"""Hidden-state cache jobs on the trainer workers: an offline `cache` job filled by the target service, then a
train job with no target at all; the cache is confined to the storage roots and owned like an output; a
trainer killed while filling resumes with whole shards only, none written twice."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.jobs.worker import Worker
from dfp_shared.records.token_shards import load_dataset
from dfp_shared.storage.store import open_store
from dfp_trainer.settings import TrainerSettings
from dfp_trainer.worker import TrainHandler
from safetensors.torch import load as st_load

from tests.trainer.data_support import write_dataset
from tests.trainer.train_support import cli, final_weights, subprocess_env, tiny_spec

pytestmark = pytest.mark.usefixtures("one_thread")
UNREACHABLE = "127.0.0.1:9"  # no target service listens here


def run_one(redis_client, settings: TrainerSettings, job_type: str, spec: dict, owner: str | None = None):
    job, _ = queue_job(redis_client, job_type, spec, owner=owner)
    jobs = JobStore(redis_client)
    Worker(TaskQueue(redis_client, "train", lease_ms=settings.lease_ms), jobs, TrainHandler(settings, redis_client),
           heartbeat_s=0.5).run(max_tasks=1, idle_exit_s=5)
    return jobs.get(job.id)


def test_an_offline_cache_job_lets_training_run_without_a_target(redis_server, redis_client, tmp_path, tiny_qwen3_dir,
                                                                  tiny_dataset, target_server):
    cache = f"file://{tmp_path}/cache"
    filler = TrainerSettings(redis_url=redis_server.url, device="cpu", target_url=f"127.0.0.1:{target_server.port}",
                             cache_shard_mb=0.004)
    rec = run_one(redis_client, filler, "cache", {"dataset": tiny_dataset, "target": str(tiny_qwen3_dir),
                                                  "output": cache, "num_draft_layers": 1})
    assert rec.state == JobState.succeeded, rec.error
    assert rec.outputs["cache"] == cache
    tokens = int(load_dataset(tiny_dataset).lengths.sum())
    shards = rec.totals["shards"]
    assert shards > 2 and rec.counters["shards"] == rec.counters["cached_shards"] == shards
    assert rec.counters["missing_shards"] == 0 and rec.counters["cache_bytes"] == tokens * 64 * 4
    target_server.stop(grace=0)  # from here on there is no target service

    trainer = TrainerSettings(redis_url=redis_server.url, device="cpu", target_url=UNREACHABLE, progress_every_s=0.01)
    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/run", hidden_states="offline",
                     hidden_state_cache=cache)
    rec = run_one(redis_client, trainer, "train", spec)
    assert rec.state == JobState.succeeded, rec.error
    assert rec.counters["steps"] == spec["steps"] and rec.counters["cached_shards"] == shards
    step, _ = final_weights(spec["output"])
    assert step == spec["steps"]
    # the same cache read by another layer set is refused, naming it
    rec = run_one(redis_client, trainer, "train", {**spec, "output": f"file://{tmp_path}/run2",
                                                   "target_layer_ids": [2]})
    assert rec.state == JobState.failed and "layer ids: the cache has [4], this run needs [2]" in rec.error


def test_a_cache_job_for_distillation_keeps_the_targets_last_layer(redis_server, redis_client, tmp_path,
                                                                    tiny_qwen3_dir, tiny_dataset, target_server):
    cache = f"file://{tmp_path}/cache"
    filler = TrainerSettings(redis_url=redis_server.url, device="cpu", target_url=f"127.0.0.1:{target_server.port}")
    rec = run_one(redis_client, filler, "cache", {"dataset": tiny_dataset, "target": str(tiny_qwen3_dir),
                                                  "output": cache, "num_draft_layers": 1, "distill": True})
    assert rec.state == JobState.succeeded, rec.error
    assert json.loads(open_store(cache).get("cache.json"))["key"]["layer_ids"] == [4, 7]
    tokens = int(load_dataset(tiny_dataset).lengths.sum())
    assert rec.counters["cache_bytes"] == tokens * 2 * 64 * 4  # the drafter's layer and the teacher's

    trainer = TrainerSettings(redis_url=redis_server.url, device="cpu", target_url=UNREACHABLE)
    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/run", hidden_states="offline",
                     hidden_state_cache=cache, distill_weight=0.5, steps=2)
    rec = run_one(redis_client, trainer, "train", spec)
    assert rec.state == JobState.succeeded, rec.error
    rec = run_one(redis_client, trainer, "train", {**spec, "output": f"file://{tmp_path}/run2", "distill_weight": 0.0})
    assert rec.state == JobState.failed and "layer ids: the cache has [4, 7], this run needs [4]" in rec.error


def test_a_cache_outside_the_roots_or_of_another_principal_is_refused(redis_server, redis_client, tmp_path,
                                                                      tiny_qwen3_dir, tiny_dataset):
    settings = TrainerSettings(redis_url=redis_server.url, device="cpu", progress_every_s=0.01)
    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/alice-run", steps=2, hidden_states="cache",
                     hidden_state_cache=f"file://{tmp_path}/alice-cache")
    rec = run_one(redis_client, settings, "train", spec, owner="alice")
    assert rec.state == JobState.succeeded, rec.error
    assert rec.counters["missing_shards"] == 0 and rec.counters["cached_shards"] >= 2
    before = sorted(open_store(f"file://{tmp_path}/alice-cache").list(""))

    bob = {**spec, "output": f"file://{tmp_path}/bob-run"}
    for mode in ("cache", "offline"):
        rec = run_one(redis_client, settings, "train", {**bob, "hidden_states": mode}, owner="bob")
        assert rec.state == JobState.failed and "spec.hidden_state_cache" in rec.error, rec.error
        assert "belongs to 'alice'" in rec.error, rec.error
    assert sorted(open_store(f"file://{tmp_path}/alice-cache").list("")) == before

    rec = run_one(redis_client, settings, "train", {**bob, "hidden_state_cache": "file:///var/tmp/dflash-elsewhere"},
                  owner="bob")
    assert rec.state == JobState.failed, rec.error
    assert "spec.hidden_state_cache" in rec.error and "outside the allowed storage" in rec.error, rec.error
    rec = run_one(redis_client, settings, "cache", {"dataset": tiny_dataset, "target": str(tiny_qwen3_dir),
                                                    "output": f"file://{tmp_path}/alice-cache"}, owner="bob")
    assert rec.state == JobState.failed and "belongs to 'alice'" in rec.error, rec.error


def shard_files(root) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted((root / "shards").glob("*.safetensors"))}


def test_a_trainer_killed_while_filling_resumes_with_whole_shards_none_written_twice(tmp_path, tiny_qwen3_dir,
                                                                                   tiny_samples):
    tokens, masks = tiny_samples
    dataset = write_dataset(f"file://{tmp_path}/tokens", tokens * 6, masks * 6, tiny_qwen3_dir, shards=3)
    cache_dir = tmp_path / "cache"
    out = f"file://{tmp_path}/run"
    args = ["trainer", "train", "--dataset", dataset, "--target", str(tiny_qwen3_dir), "--output", out]
    spec = tiny_spec(dataset, tiny_qwen3_dir, out, steps=3, hidden_states="cache",
                     hidden_state_cache=f"file://{cache_dir}")
    for k, v in spec.items():
        if k not in ("dataset", "target", "output"):
            args += ["--set", f"{k}={json.dumps(v)}"]
    env = subprocess_env(DFLASH_CACHE_SHARD_MB="0.001")  # one sample per shard: 144 shards
    proc = subprocess.Popen(cli(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    written = 0
    for line in proc.stderr:
        if '"hidden-state cache shard written"' in line:
            written += 1
            if written == 5:
                proc.send_signal(signal.SIGKILL)
                break
    proc.stderr.read()
    assert proc.wait(timeout=120) == -signal.SIGKILL
    index = json.loads((cache_dir / "cache.json").read_text())
    total = len(index["shards"])
    before = shard_files(cache_dir)
    assert 5 <= len(before) < total, (len(before), total)
    for name in before:  # each shard there is whole
        st_load((cache_dir / "shards" / name).read_bytes())

    done = subprocess.run(cli(*args), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rewritten = [line for line in done.stderr.splitlines() if '"hidden-state cache shard written"' in line]
    after = shard_files(cache_dir)
    assert len(after) == total and len(rewritten) == total - len(before)
    assert {k: after[k] for k in before} == before  # the killed run's shards untouched
    names = {json.loads(line)["shard"].rsplit("/", 1)[1] for line in rewritten}
    assert names.isdisjoint(before) and len(names) == len(rewritten)
    for name in after:
        shard = st_load((cache_dir / "shards" / name).read_bytes())
        assert shard["offsets"].numel() == 2 and shard["hidden_states"].shape[0] == int(shard["offsets"][1])
