"""Hostile dataset and hidden-state cache files fail their jobs naming the file and the limit, before anything
is sized from what they claim: a cache shard whose safetensors header claims 2^62 bytes, a token shard whose
sample boundaries go back, a manifest larger than a manifest may be or of the wrong shape."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from dfp_shared.hidden_states import CacheError, HiddenStateCache
from dfp_shared.hidden_states.cache import MAX_HEADER_BYTES
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.jobs.worker import Worker
from dfp_shared.models.loading import model_fingerprint
from dfp_shared.records.token_shards import DatasetError, encode_shard, load_dataset
from dfp_shared.storage.ownership import OutputClaims
from dfp_shared.storage.roots import StorageRoots
from dfp_shared.storage.store import open_store
from dfp_trainer.components.data.hidden_cache import run_key
from dfp_trainer.settings import TrainerSettings
from dfp_trainer.worker import TrainHandler

from tests.trainer.data_support import write_dataset
from tests.trainer.train_support import tiny_spec

pytestmark = pytest.mark.usefixtures("one_thread")
LAYER = [4]  # the default target layer of one draft layer in the 8-layer tiny target
HUGE = 1 << 62


def _run_one(redis_server, redis_client, job_type: str, spec: dict):
    settings = TrainerSettings(redis_url=redis_server.url, device="cpu", target_url="127.0.0.1:9")
    job, _ = queue_job(redis_client, job_type, spec)
    jobs = JobStore(redis_client)
    queue = TaskQueue(redis_client, "train", lease_ms=settings.lease_ms)
    Worker(queue, jobs, TrainHandler(settings, redis_client), heartbeat_s=0.5).run(max_tasks=1, idle_exit_s=5)
    return jobs.get(job.id), queue


def _zero_cache(uri: str, dataset_uri: str, target_dir) -> HiddenStateCache:
    """A complete cache of the dataset's features for the default layer (zeros: only its files matter here), its
    prefix claimed as a cache job of the same (anonymous) owner would have claimed it."""
    settings = TrainerSettings()
    OutputClaims(StorageRoots.from_settings(settings)).claim(uri, None, "filler")
    ds = load_dataset(dataset_uri)
    key = run_key(ds, model_fingerprint(target_dir), LAYER, "float32", 64, 8)
    cache = HiddenStateCache.open(uri, key, ds, shard_bytes=4000)
    lengths = ds.lengths.tolist()
    for plan in cache.shards:
        cache.write(plan, [torch.zeros(n, 64) for n in lengths[plan.first:plan.first + plan.count]])
    return cache


def test_a_cache_shard_whose_header_claims_2_62_bytes_fails_the_train_job_naming_it(redis_server, redis_client, tmp_path,
                                                                                    tiny_qwen3_dir, tiny_dataset):
    uri = f"file://{tmp_path}/cache"
    cache = _zero_cache(uri, tiny_dataset, tiny_qwen3_dir)
    for plan in cache.shards:  # every shard a run could read first
        path = tmp_path / "cache" / plan.key
        path.write_bytes(HUGE.to_bytes(8, "little") + path.read_bytes()[8:])
    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/run", hidden_states="offline",
                     hidden_state_cache=uri)
    rec, queue = _run_one(redis_server, redis_client, "train", spec)
    assert rec.state == JobState.failed
    assert f"{uri}/shards/" in rec.error and ".safetensors: the safetensors header claims 4,611,686,018,427,387,904 " \
        "bytes" in rec.error and f"at most {MAX_HEADER_BYTES:,}" in rec.error, rec.error
    assert queue.dead_letters() == [] and queue.pending() == 0  # failed at once, not retried


def test_a_cache_shard_whose_offsets_or_spans_lie_is_refused_before_a_read(tmp_path, tiny_qwen3_dir, tiny_dataset):
    uri = f"file://{tmp_path}/cache"
    cache = _zero_cache(uri, tiny_dataset, tiny_qwen3_dir)
    plan = cache.shards[0]
    path = tmp_path / "cache" / plan.key
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    start, _ = header["offsets"]["data_offsets"]
    offsets = torch.frombuffer(bytearray(data[8 + n + start:8 + n + start + 8 * (plan.count + 1)]), dtype=torch.int64)
    offsets[1] = HUGE  # one sample claims 2^62 rows of features
    path.write_bytes(data[:8 + n + start] + offsets.numpy().tobytes() + data[8 + n + start + offsets.numel() * 8:])
    with pytest.raises(CacheError, match=rf"{plan.key}: sample offsets must rise from 0 to the plan's {plan.tokens} "):
        cache.read(plan.first)
    header["hidden_states"]["data_offsets"][1] += HUGE  # a tensor past the end of the file
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (tmp_path / "cache" / cache.shards[1].key).write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    with pytest.raises(CacheError, match="tensor 'hidden_states' is .* inside the file's"):
        cache.read(cache.shards[1].first)


def test_a_token_shard_whose_sample_boundaries_go_back_fails_the_cache_job_naming_it(redis_server, redis_client,
                                                                                   tmp_path, tiny_qwen3_dir):
    store = open_store(f"file://{tmp_path}/tokens")
    good = encode_shard(["a", "b"], [[1, 2, 3], [4, 5]], [[1, 1, 1], [1, 1]])
    n = int.from_bytes(good[:8], "little")
    header = json.loads(good[8:8 + n])
    begin, end = header["offsets"]["data_offsets"]
    bad = good[:8 + n + begin] + torch.tensor([0, HUGE, 5]).numpy().tobytes() + good[8 + n + end:]
    uri = write_dataset(f"file://{tmp_path}/tokens", [[1, 2, 3]], [[1, 1, 1]], tiny_qwen3_dir, shards=1)
    manifest = json.loads(store.get("manifest.json"))
    store.put("shards/in-00000.safetensors", bad)
    manifest["shards"][0]["sha256"] = hashlib.sha256(bad).hexdigest()  # its own checksum: the checksum proves nothing
    store.put("manifest.json", json.dumps(manifest).encode())
    with pytest.raises(DatasetError, match="in-00000.safetensors: offsets must rise from 0 to the 5 tokens"):
        load_dataset(uri)
    rec, queue = _run_one(redis_server, redis_client, "cache", {"dataset": uri, "target": str(tiny_qwen3_dir),
                                                               "output": f"file://{tmp_path}/cache",
                                                               "num_draft_layers": 1})
    assert rec.state == JobState.failed and "in-00000.safetensors: offsets must rise" in rec.error, rec.error
    assert queue.dead_letters() == []


def test_a_manifest_too_large_or_of_the_wrong_shape_is_refused_naming_it(tmp_path, tiny_qwen3_dir, monkeypatch):
    import dfp_shared.records.token_shards as token_shards

    uri = write_dataset(f"file://{tmp_path}/tokens", [[1, 2, 3]], [[1, 1, 1]], tiny_qwen3_dir, shards=1)
    store = open_store(uri)
    manifest = json.loads(store.get("manifest.json"))
    monkeypatch.setattr(token_shards, "MAX_MANIFEST_BYTES", 64)
    with pytest.raises(DatasetError, match=r"manifest.json: larger than 64 bytes, the most a dataset manifest may"):
        load_dataset(uri)
    monkeypatch.undo()
    for shards, in ([{"key": ["x"], "sha256": "0"}],), ("shards/*",), ([None],):
        store.put("manifest.json", json.dumps({**manifest, "shards": shards}).encode())
        with pytest.raises(DatasetError, match="manifest.json: 'shards' must be a list of entries"):
            load_dataset(uri)
    store.put("manifest.json", b"[" * 100_000)
    with pytest.raises(DatasetError, match="manifest.json: not a JSON manifest"):
        load_dataset(uri)
