"""The promotion rule by simulation: equal candidates are promoted no more often than the level says, at every
sample size, and a true gain is found more often the more prompts there are. The normal quantile (1.96) the rule
used before promotes equal candidates far more often than its level with 2 to 4 prompts.

Per-prompt τ of the served drafter around 1.3 (sd 0.3); the candidate's is the served one plus a per-prompt
difference (sd 0.3), so the two are correlated as two drafters on the same prompts are."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dfp_adapt.rule import decide, t_quantile

RUNS = 1000
ALPHA = 0.025
SIZES = (2, 4, 8, 24, 96)
SD = 0.3
SLACK = 3 * math.sqrt(ALPHA * (1 - ALPHA) / RUNS)


def _samples(n: int, seed: int, gain: float = 0.0, spread: str = "normal") -> tuple[np.ndarray, np.ndarray]:
    """``RUNS`` paired samples of ``n`` prompts: served τ and candidate τ (served + gain + a zero-mean difference)."""
    rng = np.random.default_rng(seed)
    served = rng.normal(1.3, 0.3, size=(RUNS, n))
    if spread == "normal":
        noise = rng.normal(0.0, SD, size=(RUNS, n))
    elif spread == "student3":  # heavy tails, symmetric: Student's t with 3 degrees of freedom, scaled to sd 0.3
        noise = rng.standard_t(3, size=(RUNS, n)) * SD / math.sqrt(3.0)
    else:  # heavy tails, skewed: a lognormal difference centred on zero, sd 0.3 (rare large gains, or mirrored
        raw = rng.lognormal(0.0, 1.0, size=(RUNS, n))  # with "-": rare large losses beside many small gains)
        noise = (raw - math.exp(0.5)) * SD / math.sqrt((math.e - 1) * math.e) * (-1 if spread.startswith("-") else 1)
    return served + gain + noise, served


def promotion_rate(n: int, seed: int, gain: float = 0.0, spread: str = "normal") -> float:
    candidate, served = _samples(n, seed, gain, spread)
    return sum(decide(c, s, threshold=0.0, alpha=ALPHA, min_prompts=2).promote
               for c, s in zip(candidate.tolist(), served.tolist())) / RUNS


def normal_rule_rate(n: int, seed: int) -> float:
    """The rule before: mean difference beyond 1.96 standard errors (vectorised)."""
    candidate, served = _samples(n, seed)
    d = candidate - served
    se = d.std(axis=1, ddof=1) / math.sqrt(n)
    return float(np.mean((d.mean(axis=1) > 0) & (d.mean(axis=1) > 1.96 * se)))


@pytest.mark.parametrize("n", SIZES)
def test_equal_candidates_are_promoted_at_most_at_the_level(n):
    assert promotion_rate(n, seed=n) <= ALPHA + SLACK


@pytest.mark.parametrize("n", (2, 3, 4))
def test_the_normal_quantile_promoted_equal_candidates_beyond_the_level(n):
    assert normal_rule_rate(n, seed=n) > ALPHA + SLACK
    assert promotion_rate(n, seed=n) <= ALPHA + SLACK  # the same samples, the t rule


@pytest.mark.parametrize("n", SIZES)
def test_heavy_symmetric_tails_keep_the_level(n):
    assert promotion_rate(n, seed=100 + n, spread="student3") <= ALPHA + SLACK


def test_power_rises_with_the_prompts():
    power = [promotion_rate(n, seed=200 + n, gain=0.1) for n in SIZES]
    assert all(a <= b for a, b in zip(power, power[1:])), power
    assert power[-1] >= 0.8, power


def table() -> str:
    """The figures docs/adaptation.md quotes (python -m tests.adapt.test_rule_simulation)."""
    rows = ["| prompts | t quantile | equal, normal | equal, Student t(3) | equal, lognormal | normal 1.96, equal "
            "| equal, lognormal mirrored | gain 0.1: power |", "|---|---|---|---|---|---|---|---|"]
    for n in SIZES:
        rows.append(f"| {n} | {t_quantile(ALPHA, n):.2f} | {promotion_rate(n, n):.3f} "
                    f"| {promotion_rate(n, 100 + n, spread='student3'):.3f} "
                    f"| {promotion_rate(n, 300 + n, spread='lognormal'):.3f} | {normal_rule_rate(n, n):.3f} "
                    f"| {promotion_rate(n, 400 + n, spread='-lognormal'):.3f} "
                    f"| {promotion_rate(n, 200 + n, gain=0.1):.3f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
