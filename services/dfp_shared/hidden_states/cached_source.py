"""A hidden-state source served from a cache (:mod:`.cache`), and the filling of a cache by a target.

:class:`CachedSource` is a :class:`~.contract.HiddenStateSource` that also answers by dataset sample
(:meth:`CachedSource.sample_states`): from the cache where the sample's shard is there, else (with an
``online`` source) computed by the target and not kept. Plain ``hidden_states`` requests, which carry
no sample identity, go to the online source. :func:`fill_shards` computes missing shards with a target
source and writes each whole; a stop asked meanwhile ends it before the next forward request, and the
shard in progress is dropped (never written in part).

A sample's cached features are its forward without padding: the samples of a shard are sent grouped by
equal length, so no row of a forward is padded (a padded row's last bits depend on its batch).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch

from dfp_shared.hidden_states.cache import CacheError, HiddenStateCache, ShardPlan
from dfp_shared.hidden_states.contract import ModelInfo, SourceUnavailable
from dfp_shared.hidden_states.tensor_codec import to_dtype
from dfp_shared.records.token_shards import TokenDataset

log = logging.getLogger(__name__)

DEFAULT_REQUEST_TOKENS = 16384


class ShardStopped(Exception):
    """``should_stop`` turned true while a shard was being computed: the shard is abandoned."""


class CachedSource:
    """Features from ``cache``; the samples of missing shards (and plain requests) from ``online`` if any."""

    def __init__(self, cache: HiddenStateCache, online=None):
        self.cache, self.online = cache, online
        self.served_from_cache = 0  # samples
        self.served_online = 0

    @property
    def model(self):
        """The in-process target's model when there is one (the evaluation decodes with it)."""
        return getattr(self.online, "model", None)

    def model_info(self) -> ModelInfo:
        return self.online.model_info() if self.online is not None else self.cache.key.model_info()

    async def hidden_states(self, sequences: list[torch.Tensor], layer_ids: list[int]) -> list[torch.Tensor]:
        if self.online is None:
            raise SourceUnavailable("training from an offline hidden-state cache: no target to compute features "
                                    "of sequences that are not dataset samples")
        return await self.online.hidden_states(sequences, layer_ids)

    async def sample_states(self, indices: list[int], sequences: list[torch.Tensor],
                            layer_ids: list[int]) -> list[torch.Tensor]:
        """Features of dataset samples ``indices`` (each the first ``len(sequences[i])`` tokens of its sample)."""
        if list(layer_ids) != list(self.cache.key.layer_ids):
            raise CacheError(f"{self.cache.uri}: caches layers {list(self.cache.key.layer_ids)}, asked for "
                             f"{list(layer_ids)}")
        plans = [self.cache.locate(i) for i in indices]
        cached = [self.cache.has(p) for p in plans]
        out: list[torch.Tensor | None] = [None] * len(indices)
        hits = [k for k, c in enumerate(cached) if c]
        if hits:
            rows = await asyncio.to_thread(lambda: [self.cache.read(indices[k], int(sequences[k].numel()))
                                                    for k in hits])
            for k, r in zip(hits, rows, strict=True):
                out[k] = r
        misses = [k for k, c in enumerate(cached) if not c]
        if misses:
            if self.online is None:
                raise CacheError(f"{self.cache.uri}: shard {plans[misses[0]].key} is missing and this run has no "
                                 "target to compute it (hidden_states 'offline')")
            got = await self.online.hidden_states([sequences[k] for k in misses], layer_ids)
            for k, r in zip(misses, got, strict=True):
                out[k] = r
        self.served_from_cache += len(hits)
        self.served_online += len(misses)
        return out  # type: ignore[return-value]

    async def close(self) -> None:
        self.cache.close()
        if self.online is not None:
            await self.online.close()


async def compute_shard(source, dataset: TokenDataset, plan: ShardPlan, layer_ids: list[int], dtype: str, *,
                        max_tokens_per_request: int | None = None, inflight: int = 4,
                        should_stop: Callable[[], bool] | None = None) -> list[torch.Tensor]:
    """The features of every sample of ``plan``, each computed without padding (equal lengths share a request);
    ``should_stop`` is asked before each request is sent (:class:`ShardStopped` when it turns true)."""
    offsets = dataset.offsets.tolist()
    samples = list(range(plan.first, plan.first + plan.count))
    length = {i: offsets[i + 1] - offsets[i] for i in samples}
    budget = max_tokens_per_request or DEFAULT_REQUEST_TOKENS
    groups: dict[int, list[int]] = {}
    for i in sorted(samples, key=lambda i: length[i]):
        if length[i] > 0:
            groups.setdefault(length[i], []).append(i)
    requests = []
    for n, members in groups.items():
        per = max(1, budget // n)
        requests += [members[k:k + per] for k in range(0, len(members), per)]
    gate = asyncio.Semaphore(max(1, inflight))
    width = len(layer_ids) * int(source.model_info().hidden_size)

    async def ask(members: list[int]) -> list[torch.Tensor]:
        seqs = [dataset.input_ids[offsets[i]:offsets[i + 1]] for i in members]
        async with gate:
            if should_stop is not None and should_stop():
                raise ShardStopped(plan.key)
            return await source.hidden_states(seqs, layer_ids)

    results = await asyncio.gather(*(ask(m) for m in requests))
    want = to_dtype(dtype)
    out = {i: torch.zeros(0, width, dtype=want) for i in samples if length[i] == 0}
    for members, res in zip(requests, results, strict=True):
        if len(res) != len(members):
            raise RuntimeError(f"hidden-state source returned {len(res)} results for {len(members)} sequences")
        for i, states in zip(members, res, strict=True):
            if states.shape[0] != length[i]:
                raise RuntimeError(f"hidden states of sample {i} have {states.shape[0]} rows for {length[i]} tokens")
            out[i] = states.to("cpu").contiguous()
    return [out[i] for i in samples]


def fill_shards(cache: HiddenStateCache, source, dataset: TokenDataset, plans: list[ShardPlan], *,
                max_tokens_per_request: int | None = None, inflight: int = 4,
                written: Callable[[ShardPlan, int], None] | None = None,
                should_stop: Callable[[], bool] | None = None) -> int:
    """Compute and write each of ``plans`` not yet in the cache, one whole shard at a time; returns the
    shards this call wrote. ``written(plan, bytes)`` after each; ``should_stop()`` is asked between shards and
    before each forward request of a shard (a shard stopped part-way is not written)."""
    done = 0
    layer_ids = list(cache.key.layer_ids)
    for plan in plans:
        if should_stop is not None and should_stop():
            break
        if cache.store.exists(plan.key):  # written meanwhile (another rank, an earlier run)
            continue
        try:
            states = asyncio.run(compute_shard(source, dataset, plan, layer_ids, cache.key.dtype,
                                               max_tokens_per_request=max_tokens_per_request, inflight=inflight,
                                               should_stop=should_stop))
        except ShardStopped:
            log.info("hidden-state cache fill stopped mid-shard; the shard is not written", extra={"shard": plan.key})
            break
        size = cache.write(plan, states)
        if size:
            done += 1
            log.info("hidden-state cache shard written", extra={"shard": plan.key, "samples": plan.count,
                                                                 "tokens": plan.tokens, "bytes": size})
            if written is not None:
                written(plan, size)
    return done
