"""Batches under a token budget, deterministic shuffling, resumable sampler, per-rank shares, bad input."""

from __future__ import annotations

import pytest
import torch
from dfp_shared.records.token_shards import load_dataset
from dfp_trainer.components.data.collate import collate
from dfp_trainer.components.data.dataset import (
    BatchSampler,
    DataError,
    load_training_data,
    micro_batches,
    plan_epoch,
    rank_share,
    trainable_samples,
)

from tests.trainer.data_support import write_dataset


def _lengths(n=500, seed=0):
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed))


def test_plan_respects_budget_and_divisor_and_covers_each_sample_once():
    lengths = _lengths()
    batches = plan_epoch(lengths, 2048, seed=3, epoch=0, divisor=4)
    seen = torch.cat(batches)
    assert len(set(seen.tolist())) == seen.numel()  # no sample twice
    assert seen.numel() > lengths.numel() - 4 * 8  # only a short tail can be dropped
    for b in batches:
        assert len(b) % 4 == 0
        assert len(b) * int(lengths[b].max()) <= 2048
    # length bucketing: far less padding than random batches of the same sizes
    pad = sum(len(b) * int(lengths[b].max()) for b in batches)
    assert int(lengths[seen].sum()) / pad > 0.8


def test_shuffle_is_deterministic_per_seed_and_epoch():
    lengths = _lengths()
    a = plan_epoch(lengths, 2048, seed=1, epoch=0)
    b = plan_epoch(lengths, 2048, seed=1, epoch=0)
    c = plan_epoch(lengths, 2048, seed=1, epoch=1)
    d = plan_epoch(lengths, 2048, seed=2, epoch=0)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert [x.tolist() for x in a] != [x.tolist() for x in c]
    assert [x.tolist() for x in a] != [x.tolist() for x in d]


def test_sampler_state_resumes_exactly_across_epochs():
    lengths = _lengths(120)
    full = BatchSampler(lengths, 1024, seed=5, divisor=2)
    it = iter(full)
    reference = [next(it)[0] for _ in range(40)]  # spans several epochs
    assert full.epoch >= 1
    first = BatchSampler(lengths, 1024, seed=5, divisor=2)
    it = iter(first)
    for _ in range(17):
        _, state = next(it)
    resumed = BatchSampler(lengths, 1024, seed=5, divisor=2)
    resumed.load_state_dict(state)
    it = iter(resumed)
    rest = [next(it)[0] for _ in range(23)]
    assert all(torch.equal(x, y) for x, y in zip(reference[17:], rest, strict=True))
    with pytest.raises(ValueError, match="tokens_per_batch"):
        BatchSampler(lengths, 999, seed=5, divisor=2).load_state_dict(state)


def test_rank_shares_partition_the_batch_and_match_micro_batches():
    lengths = _lengths()
    batch = plan_epoch(lengths, 4096, seed=0, epoch=0, divisor=4)[0]
    shares = [rank_share(batch, r, 4) for r in range(4)]
    assert sorted(torch.cat(shares).tolist()) == sorted(batch.tolist())
    assert len({len(s) for s in shares}) == 1
    # 2 ranks x 2 micro-batches see the same groups as 1 rank x 4 micro-batches
    one_rank = micro_batches(rank_share(batch, 0, 1), 4)
    for r in range(2):
        for k, mb in enumerate(micro_batches(rank_share(batch, r, 2), 2)):
            assert torch.equal(mb, one_rank[r + 2 * k])


def test_collate_pads_with_tensor_ops(tmp_path, qwen3_tokenizer_dir):
    tokens = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
    masks = [[0, 1, 1], [0, 0, 1, 1, 1, 1], [1]]
    uri = write_dataset(f"file://{tmp_path}", tokens, masks, qwen3_tokenizer_dir, shards=2)
    ds = load_dataset(uri)
    b = collate(ds, torch.tensor([2, 0, 1]), max_length=5)
    assert b.input_ids.tolist() == [[10, 0, 0, 0, 0], [1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
    assert b.loss_mask.tolist() == [[1, 0, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 1]]
    assert b.lengths.tolist() == [1, 3, 5]
    assert [s.tolist() for s in b.sequences()] == [[10], [1, 2, 3], [4, 5, 6, 7, 8]]
    assert trainable_samples(ds).tolist() == [True, True, False]


def test_bad_datasets_are_clear_errors(tmp_path, qwen3_tokenizer_dir):
    empty = write_dataset(f"file://{tmp_path}/empty", [], [], qwen3_tokenizer_dir, shards=1)
    with pytest.raises(DataError, match="empty"):
        load_training_data(empty)
    other = write_dataset(f"file://{tmp_path}/other", [[1, 2, 3]], [[0, 1, 1]], qwen3_tokenizer_dir,
                          fingerprint="0123456789abcdef")
    with pytest.raises(DataError, match="tokenizer_fingerprint is '0123456789abcdef'.*another tokenizer"):
        load_training_data(other, tokenizer_fingerprint="fedcba9876543210")
    untrained = write_dataset(f"file://{tmp_path}/nomask", [[1, 2, 3]], [[0, 0, 1]], qwen3_tokenizer_dir)
    with pytest.raises(DataError, match="loss mask"):
        load_training_data(untrained)
    with pytest.raises(DataError, match="manifest"):
        load_training_data(f"file://{tmp_path}/missing")


def test_a_dataset_tokenized_without_the_mask_token_is_accepted(qwen3_tokenizer_dir, tiny_qwen3_dir):
    from dfp_shared.models.tokenizer_assets import load_tokenizer, tokenizer_fingerprint
    from dfp_trainer.loop.prepare import _fingerprints

    base = tokenizer_fingerprint(load_tokenizer(qwen3_tokenizer_dir))  # plain Qwen3, no <|MASK|>
    accepted = _fingerprints(load_tokenizer(tiny_qwen3_dir), tokenizer_fingerprint, "<|MASK|>")
    assert base in accepted and accepted[0] != base
