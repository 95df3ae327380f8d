"""The τ that held-out accuracies predict, and whether the measured τ falls short of it.

A DFlash step drafts positions 1..B-1 after the anchor; the target accepts the longest prefix of
drafts equal to its own greedy tokens. A draft at position k is therefore accepted only if positions
1..k all are. With the held-out accuracy ``a_k`` of each position (teacher-forced, as the objective
measures it: the drafter sees the true context, and position k is right when it equals the data's
token ``a + k``) and the **independence assumption** (whether position k is right does not depend on
whether positions before it were), the chance that a step accepts at least k drafts is
``prod_{j<=k} a_j`` and a step emits on average ``1 + sum_k prod_{j<=k} a_j`` tokens
(:func:`predicted_tau`): a perfect drafter predicts B, a drafter that is never right predicts 1.

Errors of neighbouring positions usually go together (a hard span is hard for every position), so the
real chance of a run of k right drafts is higher than the product, and an honest drafter's measured τ
tends to land at or a little above the prediction; held-out ``mean_accepted`` counts those runs
without the assumption. A measured τ well *below* the prediction is what the held-out accuracies
cannot explain: the drafter sees something else served than it was scored on (chat template or
thinking mode, mask token, target layers, another target or dtype, data sampled away from the
target's greedy output), a train/serve mismatch.

The measured τ (:mod:`.tau`) counts tokens emitted per verify step with the last step of each prompt
cut where its decode ended (the token budget or a stop token), which lowers it below the whole-block
value on short decodes. :func:`predicted_tau_cut` counts the prediction the same way: the expected
number of steps to emit exactly the tokens each prompt emitted, by the same rule, so the two compare
directly; :func:`predicted_tau` is the whole-block value it tends to on long decodes.

Noise (:func:`tau_interval`, :func:`predicted_interval`): the 95 % half-width of the measured τ from
its spread over prompts (each prompt a cluster of steps: the ratio estimator's standard error, with
Student's t at prompts - 1 degrees of freedom), and of the prediction from the binomial spread of each
position's accuracy over its held-out blocks, combined in quadrature (:func:`serve_gap`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Two-sided 95 % quantiles of Student's t at 1..30 degrees of freedom (above: 1.96)."""


def _t975(df: int) -> float:
    return T_975[df - 1] if df <= len(T_975) else 1.96


def _run_probs(accuracies: Sequence[float]) -> list[float]:
    """``P(a step accepts at least k drafts) = prod_{j<=k} a_j`` for k = 1..B-1."""
    probs, run = [], 1.0
    for a in accuracies:
        run *= min(max(float(a), 0.0), 1.0)
        probs.append(run)
    return probs


def predicted_tau(accuracies: Sequence[float]) -> float:
    """τ by the product rule of acceptance, whole blocks: ``1 + sum_k prod_{j<=k} a_j`` from the
    accuracy ``a_k`` of each draft position k = 1..B-1, assuming positions are right independently of
    each other (see the module docstring). A perfect drafter gives B, one never right gives 1."""
    return 1.0 + sum(_run_probs(accuracies))


def predicted_tau_cut(accuracies: Sequence[float], lengths: Sequence[int]) -> float:
    """τ by the product rule counted as :mod:`.tau` counts the measured one: prompts that emitted
    ``lengths[p]`` tokens in their verify steps, each step emitting ``1 + accepted`` tokens cut at what
    is left, so τ = total tokens / total expected steps. Without tokens: :func:`predicted_tau`."""
    total = sum(int(n) for n in lengths)
    if total <= 0:
        return predicted_tau(accuracies)
    runs = _run_probs(accuracies)
    draft_len = len(runs)
    # P(a step emits exactly e tokens, uncut), e = 1..B: accepted e-1 drafts, then the first miss
    emit = [(1.0 if e == 1 else runs[e - 2]) - (runs[e - 1] if e - 1 < draft_len else 0.0)
            for e in range(1, draft_len + 2)]
    longest = max(int(n) for n in lengths)
    steps = [0.0] * (longest + 1)  # steps[n]: expected verify steps to emit n more tokens
    for n in range(1, longest + 1):
        # emitting e >= n tokens ends the decode: steps[0] = 0
        steps[n] = 1.0 + sum(p * steps[n - e] for e, p in enumerate(emit[:n - 1], start=1))
    return total / sum(steps[int(n)] for n in lengths)


def tau_interval(new_tokens: Sequence[int], steps: Sequence[int]) -> float | None:
    """95 % half-width of the measured τ = sum(new_tokens) / sum(steps) from its spread over prompts
    (one entry per prompt): the ratio estimator's standard error with t at prompts - 1 degrees of
    freedom. None with fewer than two prompts (no spread to measure)."""
    n = len(steps)
    total_steps = sum(steps)
    if n < 2 or total_steps <= 0:
        return None
    tau = sum(new_tokens) / total_steps
    residual = sum((t - tau * s) ** 2 for t, s in zip(new_tokens, steps))
    return _t975(n - 1) * math.sqrt(residual * n / (n - 1)) / total_steps


def predicted_interval(accuracies: Sequence[float], counts: Sequence[float]) -> float:
    """95 % half-width of :func:`predicted_tau` from the binomial spread of each accuracy over its
    ``counts`` held-out blocks (delta method; positions treated as independent samples)."""
    acc = [min(max(float(a), 0.0), 1.0) for a in accuracies]
    variance = 0.0
    for i, (a, n) in enumerate(zip(acc, counts)):
        if n <= 0:
            continue
        # d tau / d a_i = sum_{k>=i} prod_{j<=k, j!=i} a_j
        run = math.prod(acc[:i])
        grad = 0.0
        for k in range(i, len(acc)):
            if k > i:
                run *= acc[k]
            grad += run
        variance += grad * grad * a * (1.0 - a) / n
    return 1.96 * math.sqrt(variance)


def serve_gap(accuracies: Sequence[float], counts: Sequence[float] | None, tau_measured: float,
              new_tokens: Sequence[int], steps: Sequence[int]) -> dict:
    """The prediction beside a measured τ, and the verdict.

    ``tau_predicted`` (counted as the measured τ, :func:`predicted_tau_cut` at each prompt's emitted
    tokens), ``tau_predicted_whole_blocks`` (:func:`predicted_tau`), ``tau_gap`` (predicted - measured:
    positive when serving falls short), ``tau_gap_noise`` (95 % half-width of the gap: the measured τ's
    spread over prompts and the prediction's binomial spread in quadrature; None with fewer than two
    prompts), ``train_serve_mismatch`` (the gap exceeds its noise) and ``mismatch_reason``.
    """
    predicted = predicted_tau_cut(accuracies, new_tokens)
    gap = predicted - tau_measured
    measured_noise = tau_interval(new_tokens, steps)
    predicted_noise = predicted_interval(accuracies, counts) if counts is not None else 0.0
    noise = None if measured_noise is None else math.hypot(measured_noise, predicted_noise)
    out = {"tau_predicted": predicted, "tau_predicted_whole_blocks": predicted_tau(accuracies), "tau_gap": gap,
           "tau_gap_noise": noise, "tau_measured_noise": measured_noise, "tau_predicted_noise": predicted_noise}
    figures = f"measured tau {tau_measured:.2f}, predicted {predicted:.2f} from the held-out accuracies"
    if noise is None:
        return {**out, "train_serve_mismatch": False,
                "mismatch_reason": f"{figures}; fewer than two prompts, so no spread to judge the gap by"}
    if gap > noise:
        reason = (f"{figures}: served falls short by {gap:.2f}, more than the noise ±{noise:.2f}; the drafter "
                  "is scored on other inputs than it is served with (chat template or thinking mode, mask "
                  "token, target layers, target model or dtype, data not the target's greedy output)")
    elif gap < -noise:
        reason = (f"{figures}: served beats the prediction by {-gap:.2f} (noise ±{noise:.2f}); neighbouring "
                  "positions' errors go together, which the product rule ignores: no mismatch")
    else:
        reason = f"{figures}: the gap {gap:+.2f} is within the noise ±{noise:.2f}"
    return {**out, "train_serve_mismatch": bool(gap > noise), "mismatch_reason": reason}
