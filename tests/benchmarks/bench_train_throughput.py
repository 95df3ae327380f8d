"""The trainer's throughput on a real target, against what the target's forward and the drafter's step allow,
and training from the hidden-state cache beside training online.

Target: SmolLM2-135M-Instruct (:mod:`dfp_dev.targets.smollm2`) when it is in the machine's cache (30 layers,
hidden 576, 9 heads / 3 KV heads, vocabulary 49,152), else a random Llama of that shape (``--tiny`` forces
it). Data: random token samples of 128..384 tokens. Recipe (the CPU recipe of the quality benchmark):
``tokens_per_batch`` 1024, block 8, ``max_anchors`` 16, one draft layer, float32 on the CPU.

Measured on the same batches, each by itself: the target's forward alone (the in-process target's
``compute`` of each batch) and the drafter's step alone (the trainer fed from features held in memory);
then the trainer's tokens/s online (target in process) and from the cache. On shared cores one batch
costs at least the sum of the two times, so the limit is ``1 / (1/target + 1/drafter)`` tokens/s; on
separate devices it would be the slower of the two. Also the cache's write and read rates beside the
storage's raw rates (``file://`` under ``--work``).

Project: the trainer's tokens/s online. Limit: the sum-of-times limit above. Last line: ``vs_limit``,
``cached_vs_online``, ``data_wait_fraction``, ``target_tokens_per_s``, ``drafter_tokens_per_s``, ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401 - import path
import torch
from _common import report

SEED = 0
RECIPE = {"tokens_per_batch": 1024, "block_size": 8, "max_anchors": 16, "num_draft_layers": 1, "max_length": 1024,
          "gamma": 4.0, "lr": 3e-3, "eval_prompts": 0, "checkpoint_every": 10 ** 6, "warmup_ratio": 0.1, "seed": SEED}


def target_dir(work: Path, tiny: bool) -> tuple[Path, str]:
    from dfp_shared.models.tokenizer_assets import default_cache_dir

    real = Path(default_cache_dir()) / "smollm2-135m-instruct"
    if not tiny and (real / ".complete").is_file():
        return real, "SmolLM2-135M-Instruct"
    from dfp_dev.targets.qwen3_tokenizer import qwen3_tokenizer_dir
    from dfp_dev.targets.tiny import build_tiny_llama

    out = build_tiny_llama(work / "llama-smollm2-shape", qwen3_tokenizer_dir(default_cache_dir()), num_layers=30,
                           hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64)
    return out, "random Llama of SmolLM2's shape"


def write_dataset(uri: str, vocab: int, samples: int) -> str:
    from dfp_shared.records.token_shards import build_manifest, encode_shard, shard_entry
    from dfp_shared.storage.store import open_store

    g = torch.Generator().manual_seed(SEED)
    lengths = torch.randint(128, 385, (samples,), generator=g).tolist()
    tokens = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    masks = [[0] * (n // 5) + [1] * (n - n // 5) for n in lengths]
    store, entries, per = open_store(uri), [], -(-samples // 2)
    for s in range(0, samples, per):
        data = encode_shard([f"s{i}" for i in range(s, min(samples, s + per))], tokens[s:s + per], masks[s:s + per])
        store.put(f"shards/part-{s:05d}.safetensors", data)
        entries.append(shard_entry(f"shards/part-{s:05d}.safetensors", data))
    store.put("manifest.json", json.dumps(build_manifest(entries)).encode())
    return uri


class MemorySource:
    """Features held in memory, served by sample: the drafter's step with no data cost."""

    def __init__(self, info, features: dict[int, torch.Tensor]):
        self.info, self.features = info, features

    def model_info(self):
        return self.info

    async def sample_states(self, indices, sequences, layer_ids):
        return [self.features[i][: int(s.numel())] for i, s in zip(indices, sequences, strict=True)]

    async def hidden_states(self, sequences, layer_ids):
        raise AssertionError("not a dataset sample")

    async def close(self):
        pass


def steady(result) -> tuple[float, float]:
    """(median tokens/s over the steps after the first two, the run's data-wait fraction)."""
    rates = [r["tokens_per_s"] for r in result.history[2:]] or [r["tokens_per_s"] for r in result.history]
    return statistics.median(rates), result.summary["data_wait_fraction"]


def rate_mb_s(nbytes: int, seconds: float) -> float:
    return nbytes / 1e6 / max(seconds, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10, help="Optimiser steps of each training run.")
    ap.add_argument("--samples", type=int, default=40, help="Samples of the random dataset.")
    ap.add_argument("--tiny", action="store_true", help="A random Llama of SmolLM2's shape even if SmolLM2 is there.")
    ap.add_argument("--work", default=None, help="Scratch directory (default: a temporary one).")
    ap.add_argument("--drafter-only", type=int, default=0, metavar="N",
                    help="Only the drafter's step alone, N runs on random features (its cost does not depend on "
                         "their values); prints each run's tokens/s and the best.")
    args = ap.parse_args()

    from dfp_shared.hidden_states import (
        CacheKey,
        HiddenStateCache,
        InProcessTarget,
        dataset_checksum,
        fill_shards,
    )
    from dfp_shared.models.loading import default_target_layer_ids, model_fingerprint
    from dfp_shared.records.token_shards import load_dataset
    from dfp_shared.specs.train import TrainSpec
    from dfp_shared.storage.store import open_store
    from dfp_trainer.components.data.collate import collate
    from dfp_trainer.components.data.dataset import BatchSampler
    from dfp_trainer.components.distributed import DistInfo
    from dfp_trainer.run import train
    from dfp_trainer.run_config import RunConfig
    from dfp_trainer.settings import TrainerSettings

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-train-"))
    os.environ["DFLASH_ALLOWED_PREFIXES"] = f"file://{work}"
    model_dir, name = target_dir(work, args.tiny)
    target = InProcessTarget(model_dir, device="cpu")
    info = target.model_info()
    layers = default_target_layer_ids(info.num_layers, RECIPE["num_draft_layers"])
    dataset_uri = write_dataset(f"file://{work}/tokens", info.vocab_size, args.samples)
    ds = load_dataset(dataset_uri)
    settings = TrainerSettings(device="cpu", storage_url=f"file://{work}")

    def run(out: str, source=None, **over):
        spec = TrainSpec.model_validate({"dataset": dataset_uri, "target": str(model_dir), "output": f"file://{work}/{out}",
                                         "steps": args.steps, **RECIPE, **over})
        t0 = time.perf_counter()
        result = train(RunConfig.compose(spec, settings, resume=False, evaluate=False), DistInfo(), source=source)
        return result, time.perf_counter() - t0

    if args.drafter_only:
        g = torch.Generator().manual_seed(SEED)
        width = len(layers) * info.hidden_size
        features = {i: torch.randn(int(n), width, generator=g) for i, n in enumerate(ds.lengths.tolist())}
        rates = [steady(run(f"drafter-alone-{k}", source=MemorySource(info, features))[0])[0]
                 for k in range(args.drafter_only)]
        print(f"drafter alone tok/s: {', '.join(f'{r:,.0f}' for r in rates)}; best {max(rates):,.0f}")
        report("train_throughput_drafter", "tokens/s", max(rates), runs=[round(r, 1) for r in rates])
        asyncio.run(target.close())
        return

    # the target's forward alone, on the batches the runs train on
    sampler = BatchSampler(ds.lengths.clamp(max=RECIPE["max_length"]), RECIPE["tokens_per_batch"], seed=SEED)
    batches = [collate(ds, idx, RECIPE["max_length"]) for (idx, _), _ in zip(sampler, range(args.steps), strict=False)]
    tokens = sum(b.num_tokens for b in batches)
    t0 = time.perf_counter()
    for b in batches:
        target.compute(b.sequences(), layers)
    target_tps = tokens / (time.perf_counter() - t0)

    # the cache filled (the target's forward of every sample, written shard by shard)
    key = CacheKey(model_fingerprint(model_dir), tuple(layers), dataset_checksum(ds.manifest), info.dtype,
                   info.hidden_size, info.num_layers)
    cache_uri = f"file://{work}/cache"
    cache = HiddenStateCache.open(cache_uri, key, ds, shard_bytes=64 << 20)
    t0 = time.perf_counter()
    fill_shards(cache, target, ds, cache.shards)
    fill_s = time.perf_counter() - t0
    cache_bytes = cache.size_bytes()

    # the drafter's step alone: the trainer fed from memory
    features = {i: cache.read(i) for i in range(ds.num_samples)}
    drafter, _ = run("drafter-alone", source=MemorySource(info, features))
    drafter_tps, _ = steady(drafter)

    online, online_s = run("online", source=target)
    online_tps, online_wait = steady(online)
    cached, cached_s = run("cached", source=target, hidden_states="cache", hidden_state_cache=cache_uri)
    cached_tps, cached_wait = steady(cached)
    asyncio.run(target.close())

    # storage: the cache's write and read rates beside the raw store's
    store = open_store(f"file://{work}/raw")
    blobs = [cache.encode(p, [features[i] for i in range(p.first, p.first + p.count)]) for p in cache.shards]
    t0 = time.perf_counter()
    for k, blob in enumerate(blobs):
        store.put(f"blob-{k}", blob)
    raw_write = rate_mb_s(sum(map(len, blobs)), time.perf_counter() - t0)
    t0 = time.perf_counter()
    for k in range(len(blobs)):
        store.get(f"blob-{k}")
    raw_read = rate_mb_s(sum(map(len, blobs)), time.perf_counter() - t0)
    again = HiddenStateCache.open(f"file://{work}/cache-again", key, ds, shard_bytes=64 << 20)
    t0 = time.perf_counter()
    for p in again.shards:
        again.write(p, [features[i] for i in range(p.first, p.first + p.count)])
    cache_write = rate_mb_s(cache_bytes, time.perf_counter() - t0)
    fresh = HiddenStateCache.open(cache_uri, key, ds)
    order = torch.randperm(ds.num_samples, generator=torch.Generator().manual_seed(SEED)).tolist()
    t0 = time.perf_counter()
    for i in order:
        fresh.read(i)
    cache_read = rate_mb_s(cache_bytes, time.perf_counter() - t0)

    limit = 1 / (1 / target_tps + 1 / drafter_tps)
    print(f"target {name}: {info.num_layers} layers x {info.hidden_size}, layers {layers}; {args.steps} steps of "
          f"{RECIPE['tokens_per_batch']} tokens; cache {cache_bytes / 1e6:.1f} MB")
    print(f"target alone {target_tps:,.0f} tok/s | drafter alone {drafter_tps:,.0f} tok/s | limit (sum of times) "
          f"{limit:,.0f} | online {online_tps:,.0f} (wait {online_wait:.2f}, {online_s:.1f} s) | cached "
          f"{cached_tps:,.0f} (wait {cached_wait:.2f}, {cached_s:.1f} s) | fill {fill_s:.1f} s")
    print(f"storage MB/s: raw write {raw_write:,.0f}, cache write {cache_write:,.0f}; raw read {raw_read:,.0f}, "
          f"cache read (per sample, shuffled) {cache_read:,.0f}")
    report("train_throughput", "tokens/s", online_tps, limit=limit, target=name,
           cached_vs_online=round(cached_tps / online_tps, 3), data_wait_fraction=round(online_wait, 3),
           data_wait_fraction_cached=round(cached_wait, 3), target_tokens_per_s=round(target_tps, 1),
           drafter_tokens_per_s=round(drafter_tps, 1), cached_tokens_per_s=round(cached_tps, 1),
           slower_of_two=round(min(target_tps, drafter_tps), 1), fill_s=round(fill_s, 2),
           cache_bytes=cache_bytes, cache_write_mb_s=round(cache_write, 1), raw_write_mb_s=round(raw_write, 1),
           cache_read_mb_s=round(cache_read, 1), raw_read_mb_s=round(raw_read, 1))


if __name__ == "__main__":
    main()
