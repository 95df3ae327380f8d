"""A stop asked while a hidden-state cache fills ends it before the next forward request, inside a shard too:
the shard in progress is dropped (only whole shards are ever written), and the next fill writes every shard."""

from __future__ import annotations

import torch
from dfp_shared.hidden_states import HiddenStateCache, fill_shards
from dfp_shared.records.token_shards import load_dataset
from dfp_trainer.components.data.hidden_cache import run_key


class CountingSource:
    """A hidden-state source answering zeros and counting its forward requests."""

    def __init__(self, info):
        self.info, self.calls = info, 0

    def model_info(self):
        return self.info

    async def hidden_states(self, sequences, layer_ids):
        self.calls += 1
        return [torch.zeros(len(s), len(layer_ids) * self.info.hidden_size) for s in sequences]


def test_a_stop_inside_a_shard_writes_nothing_of_it_and_the_next_fill_completes(tmp_path, tiny_dataset):
    ds = load_dataset(tiny_dataset)
    key = run_key(ds, "0" * 16, [4], "float32", 64, 8)
    cache = HiddenStateCache.open(f"file://{tmp_path}/cache", key, ds)
    assert cache.shards[0].count > 3  # one request per sample below: a shard takes several
    source = CountingSource(key.model_info())
    wrote = fill_shards(cache, source, ds, cache.missing(), max_tokens_per_request=1, inflight=1,
                        should_stop=lambda: source.calls >= 2)
    assert wrote == 0 and source.calls == 2  # stopped before the third request of the first shard
    assert cache.counts()["cached_shards"] == 0 and not list((tmp_path / "cache").rglob("*.safetensors"))

    wrote = fill_shards(cache, source, ds, cache.missing(), max_tokens_per_request=1, inflight=1,
                        should_stop=lambda: False)
    assert wrote == len(cache.shards) and cache.counts()["missing_shards"] == 0
    lengths = ds.lengths.tolist()
    assert cache.read(0).shape == (lengths[0], 64)
