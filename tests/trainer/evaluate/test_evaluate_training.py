"""Training a tiny drafter on the tiny target's own greedy outputs lowers the loss and raises tau.

The training loop here is deliberately minimal (the trainer service has the real one): it checks
that the model, the objective and the evaluator fit together and learn.
"""

from __future__ import annotations

import torch
from dfp_shared.models.loading import load_causal_lm
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_trainer.components.metrics.heldout import heldout_metrics
from dfp_trainer.drafter.batch import Batch
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.model import DFlashDrafter
from dfp_trainer.drafter.objective import dflash_loss
from dfp_trainer.drafter.target_parts import load_target_parts, mask_token_id
from dfp_trainer.evaluate.acceptance import acceptance_length
from dfp_trainer.evaluate.decode import chat_prompt_ids, target_features

from tests.trainer.drafter_support import chat_prompts, one_thread

NEW_TOKENS = 32
STEPS = 200


def _greedy_corpus(target, tok, prompts, layer_ids):
    """Per prompt: ids (prompt + greedy reply), loss mask (reply only), target features of every position."""
    rows = []
    for messages in prompts:
        ids = torch.tensor([chat_prompt_ids(tok, messages, enable_thinking=False)])
        with torch.no_grad():
            out = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)
            hidden = target(out, output_hidden_states=True).hidden_states
        mask = torch.zeros(out.shape[1])
        mask[ids.shape[1]:] = 1
        rows.append((out[0], mask, target_features(hidden, layer_ids)[0]))
    return rows


def _batch(rows) -> Batch:
    t = max(r[0].shape[0] for r in rows)
    width = rows[0][2].shape[1]
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t)
    feats = torch.zeros(len(rows), t, width)
    for i, (x, m, f) in enumerate(rows):
        ids[i, :len(x)], mask[i, :len(x)], feats[i, :len(x)] = x, m, f
    return Batch(ids, mask, torch.tensor([len(r[0]) for r in rows]), target_hidden=feats)


def test_training_lowers_loss_and_raises_acceptance_length(tiny_qwen3_dir):
    with one_thread():
        tok = load_tokenizer(tiny_qwen3_dir)
        target = load_causal_lm(str(tiny_qwen3_dir), device="cpu")
        parts = load_target_parts(tiny_qwen3_dir)
        cfg = DrafterConfig.for_target(parts.config, num_layers=1, block_size=8, mask_token_id=mask_token_id(tok))
        torch.manual_seed(0)
        drafter = DFlashDrafter(cfg, parts.embed_tokens, parts.lm_head)

        train_rows = _greedy_corpus(target, tok, chat_prompts(0, 16), cfg.target_layer_ids)
        heldout_prompts = chat_prompts(100, 2)
        heldout = [_batch(_greedy_corpus(target, tok, heldout_prompts, cfg.target_layer_ids))]

        before_tau = acceptance_length(drafter, target, tok, heldout_prompts, max_new_tokens=24,
                                       enable_thinking=False)
        before = heldout_metrics(drafter, heldout, max_anchors=16)

        opt = torch.optim.AdamW(drafter.trainable_parameters(), lr=1e-2, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        gen = torch.Generator().manual_seed(0)
        order = torch.randperm(len(train_rows), generator=gen).tolist()
        losses = []
        for step in range(STEPS):
            pick = [order[(step * 4 + j) % len(order)] for j in range(4)]
            loss, metrics = dflash_loss(drafter, _batch([train_rows[i] for i in pick]), max_anchors=2,
                                        generator=gen, logits_chunk=4096)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.trainable_parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(metrics["loss"])

        after = heldout_metrics(drafter, heldout, max_anchors=16)
        after_tau = acceptance_length(drafter, target, tok, heldout_prompts, max_new_tokens=24,
                                      enable_thinking=False)

    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    print(f"train loss {first:.3f} -> {last:.3f}; held-out {before['loss']:.3f} -> {after['loss']:.3f}; "
          f"tau {before_tau['tau']:.2f} -> {after_tau['tau']:.2f}; per-position {after['per_position_accuracy']}")
    assert last < 0.5 * first
    assert after["loss"] < 0.6 * before["loss"]
    assert after["accuracy"] > before["accuracy"] + 0.15
    assert after_tau["tau"] > before_tau["tau"] + 0.3
    assert sum(after_tau["accepted_hist"]) == after_tau["steps"]
    assert len(after["per_position_accuracy"]) == cfg.block_size - 1
