"""Speculative decoding is lossless (same tokens as the target's greedy decoding) and counts steps right."""

from __future__ import annotations

import pytest
import torch
from dfp_shared.models.loading import load_causal_lm
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.model import DFlashDrafter
from dfp_trainer.drafter.target_parts import load_target_parts, mask_token_id
from dfp_trainer.evaluate.acceptance import acceptance_length
from dfp_trainer.evaluate.decode import chat_prompt_ids, speculative_decode

from tests.trainer.drafter_support import chat_prompts, one_thread


def _setup(model_dir, block_size=6):
    tok = load_tokenizer(model_dir)
    target = load_causal_lm(str(model_dir), device="cpu")
    parts = load_target_parts(model_dir)
    cfg = DrafterConfig.for_target(parts.config, num_layers=1, block_size=block_size,
                                   mask_token_id=mask_token_id(tok))
    torch.manual_seed(0)
    return tok, target, DFlashDrafter(cfg, target.get_input_embeddings(), target.get_output_embeddings())


def _greedy(target, ids, n):
    with torch.no_grad():
        out = target.generate(ids[None], max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[0]:].tolist()


def test_speculative_decoding_equals_greedy_and_a_perfect_drafter_is_accepted(tiny_qwen3_dir):
    with one_thread():
        tok, target, drafter = _setup(tiny_qwen3_dir)
        ids = torch.tensor(chat_prompt_ids(tok, chat_prompts(0, 1)[0], enable_thinking=True))
        greedy = _greedy(target, ids, 20)
        out = speculative_decode(drafter, target, ids, max_new_tokens=20)
        assert out["new_ids"] == greedy
        assert sum(out["steps"]) == 19  # the first token comes from the prefill
        assert sum(out["accepted_hist"]) == len(out["steps"])
        rerun = speculative_decode(drafter, target, ids, max_new_tokens=20, use_cache=False)
        assert rerun == out

        # a drafter whose proposals are the target's own continuation is accepted whole
        class Oracle(torch.nn.Module):
            config = drafter.config
            lm_head = drafter.lm_head

            def forward(self, block, positions, context, ctx_pos, masks):
                start = int(positions[0, 0]) - ids.shape[0]
                nxt = torch.tensor(greedy[start + 1:start + block.shape[1]] + [0] * block.shape[1])
                onehot = torch.nn.functional.one_hot(nxt[:block.shape[1] - 1], self.config.vocab_size).float()
                return torch.cat([torch.zeros(1, 1, self.config.vocab_size), onehot[None]], 1)

            def logits(self, hidden):
                return hidden

            def to_target(self, ids):  # the whole vocabulary: draft ids are target ids
                return ids

            def draft(self, hidden, anchor):  # the argmax of each position, as a DFlash drafter drafts
                return hidden.argmax(-1)

        perfect = speculative_decode(Oracle(), target, ids, max_new_tokens=20)
        assert perfect["new_ids"] == greedy
        assert perfect["steps"][:3] == [6, 6, 6]  # B-1 accepted drafts + the target's bonus token


def test_acceptance_length_report(tiny_qwen3_dir):
    with one_thread():
        tok, target, drafter = _setup(tiny_qwen3_dir)
        report = acceptance_length(drafter, target, tok, chat_prompts(3, 2), max_new_tokens=8, enable_thinking=False)
    assert len(report["per_prompt"]) == 2 and report["enable_thinking"] is False
    assert report["new_tokens"] == sum(p["new_tokens"] for p in report["per_prompt"])
    assert report["tau"] == pytest.approx(report["new_tokens"] / report["steps"])
    assert len(report["accepted_hist"]) == drafter.config.block_size
    assert drafter.training  # the evaluator restores the mode it found
    with pytest.raises(ValueError, match="no evaluation prompts"):
        acceptance_length(drafter, target, tok, [], max_new_tokens=4, enable_thinking=False)


def test_hybrid_target_cached_and_rerun_agree_with_greedy(tiny_hybrid_dir):
    with one_thread():
        tok, target, drafter = _setup(tiny_hybrid_dir, block_size=4)
        ids = torch.tensor(chat_prompt_ids(tok, chat_prompts(5, 1)[0], enable_thinking=False))
        greedy = _greedy(target, ids, 8)
        cached = speculative_decode(drafter, target, ids, max_new_tokens=8, use_cache=True)
        rerun = speculative_decode(drafter, target, ids, max_new_tokens=8, use_cache=False)
    assert cached["new_ids"] == greedy == rerun["new_ids"]
