"""The τ held-out accuracies predict by the product rule, counted as the measured τ, and the verdict."""

from __future__ import annotations

import math

import pytest
from dfp_trainer.evaluate.decode import verify_decode
from dfp_trainer.evaluate.prediction import (
    predicted_interval,
    predicted_tau,
    predicted_tau_cut,
    serve_gap,
    tau_interval,
)
from dfp_trainer.evaluate.tau import tau_figures


def test_the_product_rule_on_hand_computed_numbers():
    assert predicted_tau([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert predicted_tau([0.9, 0.8, 0.5]) == pytest.approx(1 + 0.9 + 0.72 + 0.36)
    assert predicted_tau([0.9, 0.0, 1.0]) == pytest.approx(1.9)  # nothing past a position that is never right


@pytest.mark.parametrize("block", [2, 4, 16])
def test_a_perfect_drafter_predicts_b_and_a_hopeless_one_predicts_1(block):
    assert predicted_tau([1.0] * (block - 1)) == block
    assert predicted_tau([0.0] * (block - 1)) == 1.0
    assert predicted_tau_cut([0.0] * (block - 1), [7, 30]) == 1.0
    # cut where each decode ended: ceil(n / B) steps for n tokens
    lengths = [7, 30, 64]
    assert predicted_tau_cut([1.0] * (block - 1), lengths) == pytest.approx(
        sum(lengths) / sum(math.ceil(n / block) for n in lengths))


def test_the_cut_prediction_counts_the_last_step_as_tau_does():
    acc = [0.5, 0.5]  # P(emit 1, 2, 3) = 0.5, 0.25, 0.25
    assert predicted_tau_cut(acc, [1]) == 1.0
    assert predicted_tau_cut(acc, [2]) == pytest.approx(2 / 1.5)  # 1 + 0.5 * steps(1)
    assert predicted_tau_cut(acc, [3]) == pytest.approx(3 / 2.0)  # 1 + 0.5 * steps(2) + 0.25 * steps(1)
    assert predicted_tau_cut(acc, [2, 3]) == pytest.approx(5 / 3.5)  # total tokens over total steps
    assert predicted_tau_cut(acc, [4000]) == pytest.approx(predicted_tau(acc), abs=1e-3)  # long decodes: whole blocks
    assert predicted_tau_cut(acc, []) == predicted_tau(acc)


def test_the_prediction_matches_decoding_when_positions_are_independent():
    """A proposer whose drafts are right independently with the given accuracies, decoded by the real
    harness and counted by tau_figures, lands on the cut prediction."""
    import torch

    vocab, acc, budget = 11, [0.9, 0.7, 0.5], 20
    gen = torch.Generator().manual_seed(0)

    class Target(torch.nn.Module):  # greedy next token: (token + 1) mod vocab
        def forward(self, input_ids, **_):
            logits = torch.nn.functional.one_hot((input_ids + 1) % vocab, vocab).float()
            return type("Out", (), {"logits": logits})

    def propose(seq, _context, n):
        truth = (int(seq[-1]) + 1 + torch.arange(n)) % vocab
        right = torch.rand(n, generator=gen) < torch.tensor(acc[:n])
        return torch.where(right, truth, (truth + 1) % vocab)

    runs = [verify_decode(propose, Target(), torch.tensor([0]), max_new_tokens=budget, draft_len=3, use_cache=False)
            for _ in range(3000)]
    measured = tau_figures(runs, 3)["tau"]
    lengths = [sum(r["steps"]) for r in runs]
    assert lengths[0] == budget - 1  # the prefill emits the first token
    assert measured == pytest.approx(predicted_tau_cut(acc, lengths), abs=0.02)
    assert measured < predicted_tau(acc) - 0.05  # the cut matters at this budget


def test_the_noise_of_the_measured_tau_from_its_spread_over_prompts():
    # tau = 30 / 15 = 2; residuals -10, 10; se = sqrt(200 * 2 / 1) / 15; t(1 df) = 12.706
    assert tau_interval([10, 20], [10, 5]) == pytest.approx(12.706 * 20 / 15)
    assert tau_interval([20, 20, 20], [10, 10, 10]) == 0.0
    assert tau_interval([20], [10]) is None
    # the binomial spread of the prediction: one position, a = 0.5 over 100 blocks
    assert predicted_interval([0.5], [100]) == pytest.approx(1.96 * 0.05)
    assert predicted_interval([1.0, 0.0], [50, 50]) == 0.0


def test_a_drafter_served_far_below_its_prediction_is_flagged():
    acc, counts = [0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65], [400] * 7
    tokens, steps = [63] * 8, [40, 42, 38, 41, 39, 43, 40, 41]  # tau about 1.55 on every prompt
    gap = serve_gap(acc, counts, sum(tokens) / sum(steps), tokens, steps)
    assert gap["tau_predicted"] > 4 and gap["tau_gap"] > 2.5
    assert gap["train_serve_mismatch"] is True and 0 < gap["tau_gap_noise"] < 0.5
    assert "falls short" in gap["mismatch_reason"]


def test_a_drafter_served_as_predicted_is_not_flagged():
    acc, counts = [0.8, 0.6, 0.4], [200] * 3
    tokens = [31, 31, 31, 31]
    expected = predicted_tau_cut(acc, tokens)
    steps = [round(31 / expected) + d for d in (-2, 1, 0, 2)]
    gap = serve_gap(acc, counts, sum(tokens) / sum(steps), tokens, steps)
    assert gap["train_serve_mismatch"] is False and abs(gap["tau_gap"]) <= gap["tau_gap_noise"]
    assert "within the noise" in gap["mismatch_reason"]
    above = serve_gap(acc, counts, 3.5, [31] * 4, [9] * 4)  # far above: the product rule's errors, not serving
    assert above["train_serve_mismatch"] is False and "beats the prediction" in above["mismatch_reason"]
    one = serve_gap(acc, counts, 1.0, [31], [31])
    assert one["train_serve_mismatch"] is False and one["tau_gap_noise"] is None
