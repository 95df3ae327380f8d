"""The pruned draft vocabulary: its choice, the d2t mapping, the drafter's own head and the loss over draft ids."""

from __future__ import annotations

import pytest
import torch
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_trainer.components.data.draft_vocab import (
    VocabError,
    choose_draft_vocab,
    coverage,
    required_token_ids,
    trained_token_counts,
)
from dfp_trainer.drafter.batch import Batch
from dfp_trainer.drafter.objective import dflash_loss
from dfp_trainer.drafter.vocab import d2t_of, target_ids_of, target_to_draft

from tests.trainer.drafter_support import small_drafter

DRAFT_IDS = torch.tensor([2, 5, 6, 11, 17, 30, 31, 40, 57, 63, 80, 98])


def test_the_most_frequent_tokens_are_chosen_with_the_required_ones_in_ascending_target_order():
    counts = torch.zeros(20, dtype=torch.long)
    counts[[3, 7, 12, 15]] = torch.tensor([50, 9, 9, 70])  # 7 and 12 tie: the lower id wins
    ids = choose_draft_vocab(counts, 5, required=[19, 0])
    assert ids.tolist() == [0, 3, 7, 15, 19]
    assert choose_draft_vocab(counts, 2, required=[19, 0]).tolist() == [0, 19]
    # fewer trained tokens than rows: the rest by lowest id
    assert choose_draft_vocab(counts, 7, required=[]).tolist() == [0, 1, 2, 3, 7, 12, 15]


def test_impossible_vocabularies_are_refused_clearly():
    counts = torch.ones(20, dtype=torch.long)
    with pytest.raises(VocabError, match="draft_vocab_size 21 is more rows than the target has \\(20\\)"):
        choose_draft_vocab(counts, 21, required=[1])
    with pytest.raises(VocabError, match="cannot hold the 3 tokens the chat template and the stop tokens need .*at least 3"):
        choose_draft_vocab(counts, 2, required=[4, 9, 1])


def test_d2t_maps_every_draft_id_to_the_target_id_it_was_chosen_from():
    d2t = d2t_of(DRAFT_IDS)
    assert d2t.dtype == torch.int64 and d2t.shape == (12,)
    assert torch.equal(torch.arange(12) + d2t, DRAFT_IDS)  # vLLM's rule: target = draft id + d2t[draft id]
    assert torch.equal(target_ids_of(d2t), DRAFT_IDS)
    table = target_to_draft(d2t, 100)
    assert torch.equal(table[DRAFT_IDS], torch.arange(12))
    outside = torch.ones(100, dtype=torch.bool)
    outside[DRAFT_IDS] = False
    assert bool((table[outside] == -1).all())


def test_trained_token_counts_read_only_loss_masked_tokens_of_the_chosen_samples_within_max_length():
    input_ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 3], dtype=torch.int32)
    loss_mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1, 1], dtype=torch.uint8)
    offsets = torch.tensor([0, 4, 7, 10])  # samples [1 2 3 4] [5 6 7] [8 9 3]
    counts = trained_token_counts(input_ids, loss_mask, offsets, torch.tensor([0, 2]), 12, max_length=3)
    expected = torch.zeros(12, dtype=torch.long)
    expected[[2, 3, 8, 9]] = torch.tensor([1, 2, 1, 1])  # sample 0: 2, 3 (4 is past max_length); sample 2: 8, 9, 3
    assert torch.equal(counts, expected)
    figures = coverage(counts, torch.tensor([3, 8]))
    assert figures["coverage"] == pytest.approx(3 / 5) and figures["trained_tokens"] == 5
    with pytest.raises(VocabError, match="token id 9, outside the target's 9 rows"):
        trained_token_counts(input_ids, loss_mask, offsets, torch.tensor([2]), 9, max_length=8)


def test_the_chat_templates_tokens_and_the_stop_tokens_are_required(qwen3_tokenizer_dir):
    tok = load_tokenizer(qwen3_tokenizer_dir)
    vocab = tok.get_vocab()
    for thinking in (True, False):
        required = required_token_ids(tok, thinking)
        names = {t for t, i in vocab.items() if i in required}
        assert {"<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"} <= names, names
        assert "<tool_call>" not in names and "<|MASK|>" not in names and "<|vision_start|>" not in names


def _pruned(seed: int = 0):
    return small_drafter(seed, DRAFT_IDS), DRAFT_IDS


def test_the_pruned_head_is_the_targets_rows_frozen_and_drafts_only_its_tokens():
    full = small_drafter(0)
    drafter = type(full)(small_drafter(0, DRAFT_IDS).config, full.embed_tokens, full.target_lm_head, DRAFT_IDS)
    assert torch.equal(drafter.lm_head.weight, full.lm_head.weight[DRAFT_IDS])
    assert not drafter.lm_head.weight.requires_grad
    assert id(drafter.lm_head.weight) not in {id(p) for p in drafter.trainable_parameters()}
    state = drafter.state_dict()
    assert state["lm_head.weight"].shape == (12, 32) and torch.equal(state["d2t"], d2t_of(DRAFT_IDS))
    hidden = torch.randn(50, 32)
    restricted = full.logits(hidden)[:, DRAFT_IDS]
    drafted = drafter.to_target(drafter.logits(hidden).argmax(-1))
    assert torch.equal(drafted, DRAFT_IDS[restricted.argmax(-1)])  # the target's head, argmax over the vocabulary
    assert bool(torch.isin(drafted, DRAFT_IDS).all())
    with pytest.raises(ValueError, match="12 ascending target ids below 100"):
        type(full)(drafter.config, full.embed_tokens, full.target_lm_head, DRAFT_IDS.flip(0))


def _batch(ids: torch.Tensor, feats: torch.Tensor) -> Batch:
    s, t = ids.shape
    return Batch(input_ids=ids, loss_mask=torch.ones(s, t, dtype=torch.uint8), lengths=torch.full((s,), t),
                 target_hidden=feats)


def test_the_loss_counts_only_tokens_inside_the_vocabulary_and_scores_the_others_wrong():
    drafter, ids = _pruned()
    torch.manual_seed(3)
    inside = ids[torch.randint(0, 12, (2, 24))]
    batch = _batch(inside, torch.randn(2, 24, 64))
    _, clean = dflash_loss(drafter, batch, max_anchors=6, generator=torch.Generator().manual_seed(1))
    assert clean["out_of_vocab"] == 0
    mixed = inside.clone()
    mixed[:, 12:] = 99  # the mask token: never a draft vocabulary token here
    loss, m = dflash_loss(drafter, _batch(mixed, batch.target_hidden), max_anchors=6,
                          generator=torch.Generator().manual_seed(1))
    assert m["out_of_vocab"] > 0 and torch.isfinite(loss)
    assert m["num_trained_tokens"] == clean["num_trained_tokens"]  # scored, as wrong
    assert m["correct_sum"] <= m["num_trained_tokens"] - m["out_of_vocab"]
    assert m["weight_sum"] < clean["weight_sum"]  # out of the loss


def test_training_over_the_pruned_vocabulary_lowers_the_loss():
    drafter, ids = _pruned()
    torch.manual_seed(4)
    batch = _batch(ids[torch.randint(0, 12, (2, 24))], torch.randn(2, 24, 64))
    opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-2)
    losses = []
    for step in range(30):
        loss, _ = dflash_loss(drafter, batch, max_anchors=6, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5
    assert torch.equal(drafter.d2t, d2t_of(ids))  # the mapping is not trained
