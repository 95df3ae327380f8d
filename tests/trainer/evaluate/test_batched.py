"""Decoding several prompts at once gives the one-at-a-time decoder's outputs, steps and histograms exactly."""

from __future__ import annotations

import pytest
import torch
from dfp_shared.models.loading import load_causal_lm
from dfp_shared.models.stop_tokens import stop_token_ids
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_shared.specs.evaluate import EvaluateSpec
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.families import build_drafter
from dfp_trainer.drafter.target_parts import load_target_parts, mask_token_id
from dfp_trainer.evaluate.batched import ngram_decode_batch, speculative_decode_batch
from dfp_trainer.evaluate.decode import DecodeStopped, chat_prompt_ids, speculative_decode
from dfp_trainer.evaluate.ngram import ngram_decode
from pydantic import ValidationError

from tests.trainer.drafter_support import chat_prompts, one_thread

FAMILIES = {"dflash": {}, "dspark": {"markov_rank": 4},
            "dflash2": {"dflash2": dict(conv_kernel_size=3, conv_group_size=8, selector_rank=4, selector_top_k=4)}}


def _prompts(tok) -> list[torch.Tensor]:
    """Five chat prompts of different lengths (one twice as long), so rows are padded and finish apart."""
    prompts = [torch.tensor(chat_prompt_ids(tok, m, enable_thinking=True)) for m in chat_prompts(0, 5)]
    prompts[2] = torch.cat([prompts[2], prompts[0]])
    return prompts


def _loaded(model_dir):
    return load_tokenizer(model_dir), load_causal_lm(str(model_dir), device="cpu")


def _drafter(model_dir, tok, target, block_size=6, **family):
    cfg = DrafterConfig.for_target(load_target_parts(model_dir).config, num_layers=2, block_size=block_size,
                                   mask_token_id=mask_token_id(tok), **family)
    torch.manual_seed(0)
    return build_drafter(cfg, target.get_input_embeddings(), target.get_output_embeddings()).eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_decoding_equals_one_at_a_time_for_each_family(tiny_qwen3_dir, family):
    with one_thread():
        tok, target = _loaded(tiny_qwen3_dir)
        drafter = _drafter(tiny_qwen3_dir, tok, target, **FAMILIES[family])
        prompts, stops = _prompts(tok), stop_token_ids(tok)
        for whole_blocks in (True, False):  # cut blocks give rows of different block lengths near the budget
            lone = [speculative_decode(drafter, target, p, max_new_tokens=20, stop_token_ids=stops,
                                       whole_blocks=whole_blocks) for p in prompts]
            batched, again = speculative_decode_batch(drafter, target, prompts, max_new_tokens=20, batch_size=3,
                                                      stop_token_ids=stops, whole_blocks=whole_blocks)
            assert batched == lone
            assert again < len(prompts)  # the batch decoded (a near tie may send a row back, not every row)


def test_batched_ngram_equals_one_at_a_time_with_accepted_drafts(tiny_qwen3_dir):
    with one_thread():
        tok, target = _loaded(tiny_qwen3_dir)
        prompts = _prompts(tok)
        kw = dict(draft_len=5, max_new_tokens=40, min_n=1, max_n=3)
        lone = [ngram_decode(target, p, **kw) for p in prompts]
        batched, again = ngram_decode_batch(target, prompts, batch_size=4, **kw)
        assert batched == lone and again == 0  # n-gram drafts are a rule: only the target's ties could send one back
        assert sum(a for r in lone for a in r["accepted"]) > 0  # verified blocks with accepted drafts were compared


def test_a_close_decision_sends_the_row_back_to_be_decoded_alone(tiny_qwen3_dir):
    with one_thread():
        tok, target = _loaded(tiny_qwen3_dir)
        drafter = _drafter(tiny_qwen3_dir, tok, target, block_size=4)
        prompts = _prompts(tok)[:3]
        lone = [speculative_decode(drafter, target, p, max_new_tokens=8) for p in prompts]
        every, again = speculative_decode_batch(drafter, target, prompts, max_new_tokens=8, batch_size=3,
                                                tie_margin=float("inf"))
        assert every == lone and again == len(prompts)
        alone, again = speculative_decode_batch(drafter, target, prompts, max_new_tokens=8, batch_size=1)
        assert alone == lone and again == 0


def test_a_hybrid_target_is_decoded_one_at_a_time(tiny_hybrid_dir):
    with one_thread():
        tok, target = _loaded(tiny_hybrid_dir)
        drafter = _drafter(tiny_hybrid_dir, tok, target, block_size=4)
        prompts = _prompts(tok)[:2]
        lone = [speculative_decode(drafter, target, p, max_new_tokens=6) for p in prompts]
        assert speculative_decode_batch(drafter, target, prompts, max_new_tokens=6, batch_size=2) == (lone, 0)


def test_evaluate_spec_bounds_the_batch():
    base = dict(drafter="/d", target="/t", prompts=["/p.jsonl"])
    assert EvaluateSpec(**base).batch_size == 8
    with pytest.raises(ValidationError):
        EvaluateSpec(**base, batch_size=0)
    with pytest.raises(ValidationError):
        EvaluateSpec(**base, batch_size=65)


def test_a_stop_ends_each_decoder_at_the_next_step_and_an_unasked_stop_changes_nothing(tiny_qwen3_dir):
    with one_thread():
        tok, target = _loaded(tiny_qwen3_dir)
        drafter = _drafter(tiny_qwen3_dir, tok, target)
        prompts = _prompts(tok)[:3]
        asked = {"n": 0}

        def stop_after(n: int):
            asked["n"] = 0

            def should_stop() -> bool:
                asked["n"] += 1
                return asked["n"] > n

            return should_stop

        for batch_size in (1, 3):  # the lone decoder, then the batched one
            with pytest.raises(DecodeStopped):
                speculative_decode_batch(drafter, target, prompts, max_new_tokens=200, batch_size=batch_size,
                                         should_stop=stop_after(5))
            assert asked["n"] == 6  # asked before every step: the sixth question ended it
            with pytest.raises(DecodeStopped):
                ngram_decode_batch(target, prompts, draft_len=5, max_new_tokens=200, min_n=1, max_n=4,
                                   batch_size=batch_size, should_stop=stop_after(5))
            assert asked["n"] == 6
        plain, _ = speculative_decode_batch(drafter, target, prompts, max_new_tokens=12, batch_size=3)
        asked_never, _ = speculative_decode_batch(drafter, target, prompts, max_new_tokens=12, batch_size=3,
                                                  should_stop=lambda: False)
        assert asked_never == plain
