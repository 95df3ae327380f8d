"""The hidden-state cache: training from it equals training online bit for bit; a cache built for another
target, layer set, dataset or dtype is refused by name; its size is checked against the quota; s3 like file://."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from dfp_shared.hidden_states import (
    CacheKey,
    CacheMismatch,
    HiddenStateCache,
    InProcessTarget,
    dataset_checksum,
)
from dfp_shared.models.loading import model_fingerprint
from dfp_shared.records.token_shards import load_dataset
from dfp_shared.storage.store import open_store
from dfp_trainer.components.distributed import DistInfo
from dfp_trainer.loop.prepare import TrainError
from dfp_trainer.run import train
from safetensors.torch import load as st_load

from tests.trainer.data_support import write_dataset
from tests.trainer.train_support import final_weights, run_config, tiny_spec, torch_threads

STEPS = 16  # more than one epoch of the tiny dataset at 128 tokens per batch: the second epoch reads the cache again
LAYER = [4]  # the default target layer of one draft layer in the 8-layer tiny target


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


class NoTarget:
    """A hidden-state source that describes the target but refuses to compute anything."""

    def __init__(self, real):
        self.real = real
        self.calls = 0

    def model_info(self):
        return self.real.model_info()

    async def hidden_states(self, sequences, layer_ids):
        self.calls += 1
        raise AssertionError("the target was asked for hidden states")

    async def close(self):
        pass


def spec_for(dataset, target, out, **over):
    # max_length above every sample: the cache holds whole samples, the online reference forwards whole samples
    return tiny_spec(dataset, target, out, **{"steps": STEPS, "max_length": 256, **over})


def history(result) -> list[tuple]:
    return [(r["step"], r["loss"], r["accuracy"], r["grad_norm"]) for r in result.history]


def assert_same_weights(a: str, b: str, endpoint_url: str | None = None) -> None:
    (sa, wa), (sb, wb) = final_weights(a), final_weights(b, endpoint_url)
    assert sa == sb and wa.keys() == wb.keys()
    for name in wa:
        assert wa[name].dtype == wb[name].dtype == torch.float32
        assert torch.equal(wa[name], wb[name]), name


def test_training_from_the_cache_equals_training_online_bit_for_bit(tmp_path, tiny_qwen3_dir, tiny_dataset):
    # reference: online, the target forwarding each sequence alone (no padding, as the cache computes them)
    ref = spec_for(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/online")
    solo = InProcessTarget(tiny_qwen3_dir, device="cpu", token_budget=1)
    online = train(run_config(ref), DistInfo(), source=solo)
    assert online.completed

    cache = f"file://{tmp_path}/cache"
    counts: list[dict] = []
    from dfp_trainer.loop.train import Hooks

    first = train(run_config(spec_for(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/c1", hidden_states="cache",
                                      hidden_state_cache=cache)), DistInfo(), hooks=Hooks(counters=counts.append))
    assert history(first) == history(online)
    assert_same_weights(ref["output"], f"file://{tmp_path}/c1")
    total = counts[0]["cached_shards"] + counts[0]["missing_shards"]
    assert counts[0] == {"cached_shards": 0, "missing_shards": total, "cache_bytes": 0}
    tokens = int(load_dataset(tiny_dataset).lengths.sum())
    assert counts[-1] == {"cached_shards": total, "missing_shards": 0, "cache_bytes": tokens * len(LAYER) * 64 * 4}

    # a second run reads everything from the cache: the target computes nothing
    no_target = NoTarget(solo)
    second = train(run_config(spec_for(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/c2", hidden_states="cache",
                                       hidden_state_cache=cache)), DistInfo(), source=no_target)
    assert no_target.calls == 0
    assert history(second) == history(online)
    assert_same_weights(ref["output"], f"file://{tmp_path}/c2")

    # the cached features are the target's, in its dtype, shard by shard aligned with the token shards
    store = open_store(cache)
    index = json.loads(store.get("cache.json"))
    token_shards = [e["key"] for e in load_dataset(tiny_dataset).manifest["shards"]]
    assert sorted({s["token_shard"] for s in index["shards"]}) == sorted(token_shards)
    shard = st_load(store.get(index["shards"][0]["key"]))
    ds = load_dataset(tiny_dataset)
    a, b = int(ds.offsets[0]), int(ds.offsets[1])
    assert shard["hidden_states"].dtype == torch.float32
    assert torch.equal(shard["hidden_states"][: b - a], solo.compute([ds.input_ids[a:b]], LAYER)[0])
    asyncio.run(solo.close())


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory, tiny_qwen3_dir, tiny_dataset):
    """A cache of the tiny dataset for the default layer, filled by a short run."""
    root = tmp_path_factory.mktemp("built")
    cache = f"file://{root}/cache"
    with torch_threads(1):
        train(run_config(tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{root}/run", steps=1, hidden_states="cache",
                                   hidden_state_cache=cache)), DistInfo())
    return cache


def test_a_cache_for_another_layer_set_or_dtype_is_refused_by_name(tmp_path, tiny_qwen3_dir, tiny_dataset,
                                                                   built_cache):
    before = sorted(open_store(built_cache).list(""))
    layers = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/a", hidden_states="cache",
                       hidden_state_cache=built_cache, target_layer_ids=[2])
    with pytest.raises(TrainError, match=r"layer ids: the cache has \[4\], this run needs \[2\]"):
        train(run_config(layers), DistInfo())
    bf16 = InProcessTarget(tiny_qwen3_dir, device="cpu", dtype="bfloat16")
    dtype = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/b", hidden_states="cache",
                      hidden_state_cache=built_cache)
    with pytest.raises(TrainError, match="dtype: the cache has 'float32', this run needs 'bfloat16'"):
        train(run_config(dtype), DistInfo(), source=bf16)
    assert sorted(open_store(built_cache).list("")) == before  # nothing mixed in


def test_a_cache_for_another_target_or_dataset_is_refused_by_name(tmp_path, tiny_qwen3_dir, tiny_dataset,
                                                                  tiny_samples, built_cache):
    # another target: the same checkpoint with another config is another fingerprint
    other = tmp_path / "other-target"
    shutil.copytree(tiny_qwen3_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "initializer_range": 0.5}))
    spec = tiny_spec(tiny_dataset, other, f"file://{tmp_path}/t", hidden_states="cache",
                     hidden_state_cache=built_cache)
    with pytest.raises(TrainError, match=r"target \(fingerprint\): the cache has '\w+', this run needs "
                                         f"'{model_fingerprint(other)}'"):
        train(run_config(spec), DistInfo())
    # another dataset: the same samples in other shards
    tokens, masks = tiny_samples
    other_ds = write_dataset(f"file://{tmp_path}/other-ds", tokens, masks, tiny_qwen3_dir, shards=3)
    spec = tiny_spec(other_ds, tiny_qwen3_dir, f"file://{tmp_path}/d", hidden_states="cache",
                     hidden_state_cache=built_cache)
    with pytest.raises(TrainError, match=r"dataset \(manifest checksum\): the cache has '[0-9a-f]{64}'"):
        train(run_config(spec), DistInfo())
    # the key of every field is checked when the cache is opened, each difference named
    ds = load_dataset(tiny_dataset)
    key = CacheKey(model_fingerprint(tiny_qwen3_dir), (4,), dataset_checksum(ds.manifest), "float32", 64, 8)
    HiddenStateCache.open(built_cache, key, ds, create=False)
    wrong = CacheKey("0" * 16, (1, 2), "f" * 64, "bfloat16", 64, 8)
    with pytest.raises(CacheMismatch) as err:
        HiddenStateCache.open(built_cache, wrong, ds, create=False)
    for name in ("target (fingerprint)", "layer ids", "dataset (manifest checksum)", "dtype"):
        assert name in str(err.value)


def test_offline_training_needs_a_complete_cache(tmp_path, tiny_qwen3_dir, tiny_dataset):
    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/run", hidden_states="offline",
                     hidden_state_cache=f"file://{tmp_path}/none")
    with pytest.raises(TrainError, match="no hidden-state cache here"):
        train(run_config(spec, target_url="127.0.0.1:9"), DistInfo())


def test_a_cache_above_the_quota_is_refused_with_its_estimate(tmp_path, tiny_qwen3_dir, tiny_dataset):
    tokens = int(load_dataset(tiny_dataset).lengths.sum())
    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/run", hidden_states="cache",
                     hidden_state_cache=f"file://{tmp_path}/cache")
    with pytest.raises(TrainError, match=rf"would take [0-9.]+ GB \({tokens} tokens x 1 layers x 64 hidden x 4 "
                                         r"bytes \(float32\) = 256 bytes per token\), above this trainer's quota "
                                         r"of 1e-06 GB \(DFLASH_CACHE_QUOTA_GB\)"):
        train(run_config(spec, cache_quota_gb=1e-6), DistInfo())
    assert not list(open_store(f"file://{tmp_path}/cache").list(""))  # refused before anything was written


def test_a_cache_on_s3_works_like_one_on_disk(tmp_path, s3_server, s3_bucket, tiny_qwen3_dir, tiny_dataset):
    ondisk = spec_for(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/disk", hidden_states="cache",
                      hidden_state_cache=f"file://{tmp_path}/cache")
    disk = train(run_config(ondisk, cache_shard_mb=0.004), DistInfo())
    ons3 = spec_for(tiny_dataset, tiny_qwen3_dir, f"{s3_bucket}/run", hidden_states="cache",
                    hidden_state_cache=f"{s3_bucket}/cache")
    config = run_config(ons3, cache_shard_mb=0.004, s3_endpoint_url=s3_server.endpoint_url)
    s3 = train(config, DistInfo())
    assert history(s3) == history(disk)
    assert_same_weights(ondisk["output"], ons3["output"], s3_server.endpoint_url)
    local, remote = open_store(f"file://{tmp_path}/cache"), open_store(f"{s3_bucket}/cache",
                                                                       endpoint_url=s3_server.endpoint_url)
    keys = sorted(local.list("shards/"))
    assert len(keys) > 2 and keys == sorted(remote.list("shards/"))
    for key in keys:
        assert local.get(key) == remote.get(key)
    # and a second run reads it back from s3
    again = train(run_config({**ons3, "output": f"{s3_bucket}/run2"}, s3_endpoint_url=s3_server.endpoint_url),
                  DistInfo(), source=NoTarget(InProcessTarget(tiny_qwen3_dir, device="cpu")))
    assert history(again) == history(disk)


def test_distilling_from_the_cache_equals_distilling_online_bit_for_bit(tmp_path, tiny_qwen3_dir, tiny_dataset,
                                                                       built_cache):
    distill = dict(distill_weight=0.5, steps=6)  # the cache is complete before the first step: every step reads it
    solo = InProcessTarget(tiny_qwen3_dir, device="cpu", token_budget=1)
    ref = spec_for(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/online", **distill)
    online = train(run_config(ref), DistInfo(), source=solo)
    assert online.completed

    # the cache keeps the target's last layer (the teacher) after the drafter's, and says so in its key
    cache = f"file://{tmp_path}/cache"
    first = train(run_config(spec_for(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/c1", hidden_states="cache",
                                      hidden_state_cache=cache, **distill)), DistInfo())
    assert json.loads(open_store(cache).get("cache.json"))["key"]["layer_ids"] == LAYER + [7]
    assert history(first) == history(online)
    assert_same_weights(ref["output"], f"file://{tmp_path}/c1")

    # read back with no target at all: the teacher's logits come from the cache alone
    no_target = NoTarget(solo)
    second = train(run_config(spec_for(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/c2", hidden_states="cache",
                                       hidden_state_cache=cache, **distill)), DistInfo(), source=no_target)
    assert no_target.calls == 0
    assert history(second) == history(online)
    assert_same_weights(ref["output"], f"file://{tmp_path}/c2")
    asyncio.run(solo.close())

    # a cache of the drafter's layer alone is refused, not read without its teacher
    before = sorted(open_store(built_cache).list(""))
    old = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/old", hidden_states="cache",
                    hidden_state_cache=built_cache, **distill)
    with pytest.raises(TrainError, match=r"layer ids: the cache has \[4\], this run needs \[4, 7\]"):
        train(run_config(old), DistInfo())
    assert sorted(open_store(built_cache).list("")) == before
