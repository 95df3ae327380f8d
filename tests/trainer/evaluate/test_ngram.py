"""N-gram (prompt-lookup) speculation: the proposal rule, τ on sequences whose acceptance is known by hand,
and losslessness against the tiny Qwen3 target's greedy output."""

from __future__ import annotations

import pytest
import torch
from dfp_shared.models.loading import load_causal_lm
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_trainer.evaluate.decode import chat_prompt_ids
from dfp_trainer.evaluate.ngram import ngram_decode, propose_ngram
from dfp_trainer.evaluate.tau import tau_figures

from tests.trainer.drafter_support import chat_prompts, one_thread


def test_the_longest_suffix_that_occurred_earlier_proposes_what_followed_its_earliest_occurrence():
    # the rule's worked example: [4, 2, 3] does not occur earlier, [2, 3] does: three tokens follow it
    assert propose_ngram([1, 2, 3, 4, 2, 3], k=4, min_n=2, max_n=3) == [4, 2, 3]
    assert propose_ngram([1, 2, 3, 4, 2, 3], k=2, min_n=2, max_n=3) == [4, 2]
    # of several occurrences of the suffix, the earliest
    assert propose_ngram([5, 1, 9, 1, 7, 1], k=2, min_n=1, max_n=1) == [9, 1]
    # a longer match wins over a shorter earlier one: [3, 1] occurs at 3, [1] first at 0
    assert propose_ngram([1, 8, 8, 3, 1, 6, 3, 1], k=1, min_n=1, max_n=2) == [6]
    # nothing long enough occurs earlier: no drafts
    assert propose_ngram([1, 2, 3, 4, 2, 3], k=4, min_n=3, max_n=3) == []
    assert propose_ngram([7], k=4, min_n=1, max_n=4) == []
    assert propose_ngram([1, 2, 1, 2], k=0, min_n=1, max_n=2) == []
    with pytest.raises(ValueError, match="min_n <= max_n"):
        propose_ngram([1, 2], k=1, min_n=3, max_n=2)


class SuccessorLM(torch.nn.Module):
    """A causal LM whose greedy next token after token t is (t + 1) mod V: its continuation is known."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.config = type("Config", (), {"layer_types": None})()

    def forward(self, input_ids, output_hidden_states=False, use_cache=False, **_):
        logits = torch.nn.functional.one_hot((input_ids + 1) % self.vocab, self.vocab).float()
        return type("Out", (), {"logits": logits, "hidden_states": None})()


def _decode(prompt, **kw):
    return ngram_decode(SuccessorLM(10), torch.tensor(prompt), use_cache=False, **kw)


def test_tau_on_a_repeating_sequence_equals_its_value_by_hand():
    prompt = list(range(10)) + [0, 1, 2]  # the target continues 3, 4, 5, ... (mod 10): the prompt's own cycle
    out = _decode(prompt, draft_len=4, max_new_tokens=11, min_n=1, max_n=3)
    # prefill: 3. Step 1: suffix [1, 2, 3] first occurs at 1 -> drafts [4, 5, 6, 7], all accepted, + 8.
    # Step 2: suffix [6, 7, 8] at 6 -> drafts [9, 0, 1, 2], all accepted, + 3: 11 tokens, the budget.
    assert out["new_ids"] == [3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3]
    assert out["steps"] == [5, 5] and out["accepted"] == [4, 4] and out["drafted"] == [4, 4]
    figures = tau_figures([out], 4)
    assert figures["tau"] == 5.0 and figures["tau_vllm"] == 5.0
    assert figures["accepted_hist"] == [0, 0, 0, 0, 2] and figures["position_acceptance"] == [1.0] * 4

    # two tokens fewer: step 2 still verifies its whole block (4 accepted) but emits only the 3 left
    short = _decode(prompt, draft_len=4, max_new_tokens=9, min_n=1, max_n=3)
    assert short["steps"] == [5, 3] and short["accepted"] == [4, 4]
    figures = tau_figures([short], 4)
    assert figures["tau"] == 8 / 2 and figures["tau_vllm"] == 1 + 8 / 2
    # cut at the budget instead, step 2 drafts only the 3 tokens left
    cut = _decode(prompt, draft_len=4, max_new_tokens=9, min_n=1, max_n=3, whole_blocks=False)
    assert cut["new_ids"] == short["new_ids"] and cut["steps"] == [5, 3] and cut["accepted"] == [4, 3]
    assert tau_figures([cut], 4)["tau_vllm"] == 1 + 7 / 2


def test_tau_with_rejected_drafts_and_steps_without_any():
    # prefill: 2. Step 1: suffix [1, 2] occurs at 0 -> drafts [9, 0, 1]; the target wants 3: none accepted.
    # Steps 2, 3: [2, 3] / [3] and [3, 4] / [4] never occurred: no drafts, one token each.
    out = _decode([1, 2, 9, 0, 1], draft_len=3, max_new_tokens=4, min_n=1, max_n=2)
    assert out["new_ids"] == [2, 3, 4, 5]
    assert out["drafted"] == [3, 0, 0] and out["accepted"] == [0, 0, 0] and out["steps"] == [1, 1, 1]
    figures = tau_figures([out], 3)
    assert figures["tau"] == 1.0  # 3 tokens in 3 verify steps
    assert figures["tau_vllm"] == 1.0 and figures["drafting_steps"] == 1  # vLLM counts only the step that drafted
    assert figures["accepted_hist"] == [3, 0, 0, 0] and figures["position_acceptance"] == [0.0, 0.0, 0.0]


def test_ngram_decoding_equals_the_target_s_greedy_output(tiny_qwen3_dir):
    with one_thread():
        tok = load_tokenizer(tiny_qwen3_dir)
        target = load_causal_lm(str(tiny_qwen3_dir), device="cpu")
        ids = torch.tensor(chat_prompt_ids(tok, chat_prompts(2, 1)[0], enable_thinking=True))
        with torch.no_grad():
            greedy = target.generate(ids[None], max_new_tokens=24, do_sample=False, pad_token_id=0)[0, ids.shape[0]:]
        out = ngram_decode(target, ids, draft_len=5, max_new_tokens=24, min_n=1, max_n=3)
        rerun = ngram_decode(target, ids, draft_len=5, max_new_tokens=24, min_n=1, max_n=3, use_cache=False)
    assert out["new_ids"] == greedy.tolist()
    assert rerun == out
    assert sum(out["drafted"]) > 0  # a random target repeats itself: lookup finds drafts to verify
