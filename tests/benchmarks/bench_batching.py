"""Batch assembly throughput (tokens/s) for the trainer's input pipeline.

Project: the trainer's path — the token dataset loaded once into flat tensors
(``dfp_trainer.components.data.dataset``: manifest -> safetensors shards), batches planned under a token budget with
length bucketing, each batch filled by one slice copy per sample into zeroed tensors (``collate``).
Baseline: the common path — a Hugging Face dataset from ``datasets.load_from_disk``, ``dataset[i]``
random access per sample and padding through Python lists, then ``torch.tensor``.
Limit: only the irreducible work — moving the same number of token ids and mask bytes with one
contiguous copy per batch (no padding, no per-sample slices, no planning).
All three assemble the same batches; the fast project and limit passes are timed best of 3, the
baseline once (time-capped). Unit: real (unpadded) tokens per second.
Samples are log-normal in length with the mean of the users' thinking-mode data (1.64 B output
tokens over 914 K completions, about 1,800), cut at the trainer's default ``max_length``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import best_of, report
from dfp_shared.records.token_shards import build_manifest, encode_shard, shard_entry
from dfp_shared.storage.store import open_store
from dfp_trainer.components.data.collate import collate
from dfp_trainer.components.data.dataset import BatchSampler, load_training_data


def synthetic(num: int, mean_length: float = 1800, max_length: int = 3072, seed: int = 0
              ) -> tuple[list[list[int]], list[list[int]]]:
    """Log-normal sample lengths (sigma 0.8) of the given mean, cut at ``max_length`` as the tokenizer does."""
    g = torch.Generator().manual_seed(seed)
    mu = math.log(mean_length) - 0.8 ** 2 / 2
    lengths = torch.exp(torch.empty(num).normal_(mu, 0.8, generator=g)).clamp(16, max_length).long().tolist()
    tokens, masks = [], []
    for n in lengths:
        tokens.append(torch.randint(0, 151_000, (n,), generator=g).tolist())
        cut = n // 4
        masks.append([0] * cut + [1] * (n - cut))
    return tokens, masks


def write_project(root: Path, tokens, masks, shards: int = 8) -> str:
    store = open_store(f"file://{root}")
    per = -(-len(tokens) // shards)
    entries = []
    for s in range(0, len(tokens), per):
        data = encode_shard([f"s{i}" for i in range(s, min(len(tokens), s + per))], tokens[s:s + per],
                            masks[s:s + per], {"tokenizer_fingerprint": "bench", "chat_template_fingerprint": "bench"})
        key = f"shards/part-{s:06d}.safetensors"
        store.put(key, data)
        entries.append(shard_entry(key, data))
    store.put("manifest.json", json.dumps(build_manifest(entries)).encode())
    return f"file://{root}"


def run_baseline(uri: str, hf_dir: str, plan: list[list[int]], real: list[int], seconds: float) -> tuple[float, int]:
    """The common path: a Hugging Face dataset from ``load_from_disk``, ``dataset[i]`` per sample, padding
    through Python lists (the dataset is saved first, untimed)."""
    from datasets import Dataset, load_from_disk

    ds = load_training_data(uri)
    rows = [(ds.input_ids[a:b].tolist(), ds.loss_mask[a:b].tolist())
            for a, b in zip(ds.offsets[:-1].tolist(), ds.offsets[1:].tolist(), strict=True)]
    Dataset.from_dict({"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows]}).save_to_disk(hf_dir)
    del rows, ds
    hf = load_from_disk(hf_dir)
    done_tokens, batches, t0 = 0, 0, time.perf_counter()
    for idx, n in zip(plan, real, strict=True):
        samples = [hf[int(i)] for i in idx]
        width = max(len(r["input_ids"]) for r in samples)
        ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in samples])
        mask = torch.tensor([r["loss_mask"] + [0] * (width - len(r["loss_mask"])) for r in samples])
        assert ids.shape == mask.shape
        done_tokens += n
        batches += 1
        if time.perf_counter() - t0 > seconds:
            break
    return done_tokens / (time.perf_counter() - t0), batches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--mean-length", type=float, default=1800,
                    help="Mean sample length before the cut; the default is the users' thinking-mode data "
                         "(1.64 B output tokens over 914 K completions).")
    ap.add_argument("--max-length", type=int, default=3072, help="The trainer's max_length (its default).")
    ap.add_argument("--tokens-per-batch", type=int, default=16384, help="The trainer's default.")
    ap.add_argument("--baseline-seconds", type=float, default=20.0, help="Time cap of the (slow) baseline.")
    ap.add_argument("--baseline-job", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline_job:
        job = json.loads(Path(args.baseline_job).read_text())
        print(json.dumps(run_baseline(job["uri"], job["hf_dir"], job["plan"], job["real"], job["seconds"])))
        return
    torch.set_num_threads(1)
    tokens, masks = synthetic(args.samples, args.mean_length, args.max_length)
    with tempfile.TemporaryDirectory() as tmp:
        uri = write_project(Path(tmp) / "tokens", tokens, masks)
        del tokens, masks

        t0 = time.perf_counter()
        ds = load_training_data(uri)
        load_s = time.perf_counter() - t0
        sampler = BatchSampler(ds.lengths, args.tokens_per_batch, seed=0)
        plan = [idx for (idx, _), _ in zip(sampler, range(sampler.batches_per_epoch()), strict=False)]
        real = [int(ds.lengths[idx].sum()) for idx in plan]

        # project: collate every batch of the epoch (best of 3 passes, as for the limit)
        def project_pass():
            for idx in plan:
                collate(ds, idx, args.max_length)

        project = sum(real) / best_of(project_pass)

        # limit: move the same number of token ids and mask bytes with one contiguous copy per batch
        n_flat = ds.input_ids.numel()
        ids_out = torch.empty(max(real), dtype=ds.input_ids.dtype)
        mask_out = torch.empty(max(real), dtype=ds.loss_mask.dtype)
        def limit_pass():
            for k, n in enumerate(real):
                a = (k * 7919) % max(1, n_flat - n)
                ids_out[:n].copy_(ds.input_ids[a:a + n])
                mask_out[:n].copy_(ds.loss_mask[a:a + n])

        limit = sum(real) / best_of(limit_pass)

        # baseline in its own interpreter: importing `datasets` (pyarrow) slows numpy copies in the
        # importing process, so each path runs in a clean one, as each user's loader would
        job = Path(tmp) / "baseline.json"
        job.write_text(json.dumps({"uri": uri, "hf_dir": str(Path(tmp) / "hf"), "plan": [i.tolist() for i in plan],
                                   "real": real, "seconds": args.baseline_seconds}))
        out = subprocess.run([sys.executable, __file__, "--baseline-job", str(job)], capture_output=True, text=True,
                             check=True)
        baseline, baseline_batches = json.loads(out.stdout.strip().splitlines()[-1])
    report("batching", "tokens/s", project, baseline, limit, samples=args.samples,
           mean_length=round(float(ds.lengths.float().mean()), 1), batches=len(plan),
           baseline_batches=baseline_batches, dataset_load_s=round(load_s, 3),
           padding_efficiency=round(sum(real) / sum(len(i) * int(ds.lengths[i].max()) for i in plan), 3))


if __name__ == "__main__":
    main()
