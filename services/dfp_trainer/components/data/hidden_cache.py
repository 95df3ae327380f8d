"""The run's hidden-state cache (``hidden_states: cache | offline``): opened for the run's key, sized against
the trainer's quota, completed with the target (``cache``) and served to the input pipeline.

``cache``: the missing shards are computed first, shard by shard, each written whole (the ranks split
them: rank ``r`` takes every ``world``-th), then every epoch reads the cache; a run killed meanwhile
leaves whole shards, and the next run computes only the rest. A stop asked while filling ends the fill
before the next forward request (a shard stopped part-way is not written); the samples of shards still
missing are then computed online and not kept.
``offline``: the cache a ``cache`` job filled must be complete; no target is opened.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dfp_shared.hidden_states import (
    CachedSource,
    CacheError,
    CacheKey,
    HiddenStateCache,
    dataset_checksum,
    estimate_bytes,
    fill_shards,
)
from dfp_shared.records.token_shards import TokenDataset

from ...settings import TrainerSettings
from ..distributed import DistInfo, barrier

log = logging.getLogger(__name__)

GB = 1e9


def run_key(dataset: TokenDataset, target_fingerprint: str, layer_ids: list[int], dtype: str, hidden_size: int,
            num_layers: int) -> CacheKey:
    return CacheKey(target_fingerprint, tuple(int(i) for i in layer_ids), dataset_checksum(dataset.manifest), dtype,
                    int(hidden_size), int(num_layers))


def check_quota(dataset: TokenDataset, key: CacheKey, settings: TrainerSettings, uri: str) -> int:
    """The cache's estimated size; CacheError above the trainer's quota, with the estimate."""
    size = estimate_bytes(dataset, key)
    quota = settings.cache_quota_gb * GB
    if size > quota:
        tokens = int(dataset.lengths.sum())
        raise CacheError(f"hidden_state_cache {uri}: the cache would take {size / GB:.3f} GB ({tokens} tokens x "
                         f"{len(key.layer_ids)} layers x {key.hidden_size} hidden x "
                         f"{key.bytes_per_token // (len(key.layer_ids) * key.hidden_size)} bytes ({key.dtype}) = "
                         f"{key.bytes_per_token} bytes per token), above this trainer's quota of "
                         f"{settings.cache_quota_gb:g} GB (DFLASH_CACHE_QUOTA_GB)")
    return size


def open_cache(uri: str, key: CacheKey, dataset: TokenDataset, settings: TrainerSettings, *,
               create: bool, ignore: tuple[str, ...] = ()) -> HiddenStateCache:
    if create:
        check_quota(dataset, key, settings, uri)
    return HiddenStateCache.open(uri, key, dataset, create=create, shard_bytes=int(settings.cache_shard_mb * 1e6),
                                 endpoint_url=settings.s3_endpoint_url, ignore=ignore)


def complete(cache: HiddenStateCache, source, dataset: TokenDataset, info: DistInfo, settings: TrainerSettings, *,
             max_tokens_per_request: int | None, counters: Callable[[dict], None] | None = None,
             should_stop: Callable[[], bool] | None = None) -> dict:
    """Compute the cache's missing shards (this rank's share), wait for every rank; returns the counts."""
    missing = cache.missing()
    if info.is_main:
        counts = cache.counts()
        log.info("hidden-state cache opened", extra={"cache": cache.uri, **counts,
                                                     "size_bytes": cache.size_bytes()})
        if counters is not None:
            counters(counts)
    mine = missing[info.rank::info.world_size]
    state = {"written": 0, "bytes": 0}

    def written(_plan, size: int) -> None:
        state["written"] += 1
        state["bytes"] += size
        if counters is not None and info.is_main:
            counters({"cached_shards": len(cache.shards) - len(missing) + state["written"],
                      "missing_shards": len(missing) - state["written"]})

    fill_shards(cache, source, dataset, mine, max_tokens_per_request=max_tokens_per_request,
                inflight=settings.fetch_inflight, written=written, should_stop=should_stop)
    barrier(info)
    counts = cache.counts()
    if info.is_main:
        log.info("hidden-state cache ready", extra={"cache": cache.uri, **counts, "written_here": state["written"]})
        if counters is not None:
            counters(counts)
    return counts


def cached_source(config, info: DistInfo, dataset: TokenDataset, *, online, target_fingerprint: str,
                  layer_ids: list[int], hidden_size: int, num_layers: int, max_tokens_per_request: int | None,
                  counters: Callable[[dict], None] | None = None,
                  should_stop: Callable[[], bool] | None = None) -> CachedSource:
    """The run's source for ``hidden_states`` ``cache`` (``online`` given: completed first) or ``offline``."""
    spec, settings = config.spec, config.settings
    uri = spec.hidden_state_cache
    if spec.hidden_states == "offline":
        key = run_key(dataset, target_fingerprint, layer_ids, "", hidden_size, num_layers)
        cache = open_cache(uri, key, dataset, settings, create=False, ignore=("dtype",))
        counts = cache.counts()
        if counters is not None and info.is_main:
            counters(counts)
        if counts["missing_shards"]:
            raise CacheError(f"hidden_state_cache {uri}: {counts['missing_shards']} of {len(cache.shards)} shards are "
                             "missing; training with hidden_states 'offline' needs a complete cache (run the `cache` "
                             "job again to complete it, or train with hidden_states 'cache')")
        return CachedSource(cache)
    minfo = online.model_info()
    key = run_key(dataset, target_fingerprint, layer_ids, str(minfo.dtype), hidden_size, num_layers)
    cache = open_cache(uri, key, dataset, settings, create=True)
    complete(cache, online, dataset, info, settings, max_tokens_per_request=max_tokens_per_request,
             counters=counters, should_stop=should_stop)
    return CachedSource(cache, online)
