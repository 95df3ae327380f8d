"""When a candidate replaces what is served: its gain over the served one must be beyond the noise of a sample.

Both are evaluated on the same held-out prompts (the newest traffic), so the comparison is paired: for each
prompt the difference ``d_i = candidate_i - served_i`` (of tokens per second, or of τ). With ``n`` prompts, the
mean ``d̄`` and its standard error ``se = s_d / sqrt(n)`` (``s_d`` the sample standard deviation of the
differences), the candidate is promoted only when

    n >= min_prompts   and   d̄ > threshold   and   d̄ > t(1 - alpha, n - 1) · se

that is, enough paired prompts to measure the noise at all, a gain of at least the operator's margin, and a gain
that a one-sided paired t test at level ``alpha`` tells from zero. The quantile is Student's t at ``n - 1``
degrees of freedom, not the normal one: with few prompts the standard error is itself a noisy estimate, and the
normal 1.96 would promote on noise (the t quantile at 1 degree of freedom is 12.7, at 3 it is 3.18; it comes
down to 1.98 at 100 prompts). Differences with no spread at all and a gain above the margin are promoted.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from scipy.stats import t as student_t

MIN_PROMPTS_FLOOR = 2  # the least any operator may set: one difference measures no spread
MAX_MIN_PROMPTS = 10_000
MIN_ALPHA, MAX_ALPHA = 0.0001, 0.5
MAX_THRESHOLD = 1e9  # the margin is in the compared unit (tokens per second, or τ); only finite and not negative


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    prompts: int  # paired prompts compared
    mean_candidate: float
    mean_baseline: float
    mean_difference: float
    standard_error: float
    threshold: float
    alpha: float
    t_quantile: float  # t(1 - alpha, n - 1); 0 when too few prompts

    def as_dict(self) -> dict:
        return asdict(self)


def check_rule(threshold: float, alpha: float, min_prompts: int) -> None:
    """The rule's own numbers, bounded (raises ValueError naming the one out of range)."""
    if not (math.isfinite(threshold) and 0.0 <= threshold <= MAX_THRESHOLD):
        raise ValueError(f"threshold {threshold}: expected a finite number 0..{MAX_THRESHOLD:g}")
    if not (math.isfinite(alpha) and MIN_ALPHA <= alpha <= MAX_ALPHA):
        raise ValueError(f"alpha {alpha}: expected {MIN_ALPHA}..{MAX_ALPHA} (one-sided level)")
    if type(min_prompts) is not int or not MIN_PROMPTS_FLOOR <= min_prompts <= MAX_MIN_PROMPTS:
        raise ValueError(f"min_prompts {min_prompts!r}: expected {MIN_PROMPTS_FLOOR}..{MAX_MIN_PROMPTS}")


def t_quantile(alpha: float, n: int) -> float:
    """The one-sided critical value of the paired t test: Student's t quantile at 1 - alpha, n - 1 degrees of freedom."""
    return float(student_t.ppf(1.0 - alpha, n - 1))


def paired(candidate: dict[str, float], baseline: dict[str, float]) -> tuple[list[float], list[float]]:
    """The values of the prompts both hold finite (by prompt id, in id order)."""
    ids = sorted(i for i in set(candidate) & set(baseline) if math.isfinite(candidate[i]) and math.isfinite(baseline[i]))
    return [candidate[i] for i in ids], [baseline[i] for i in ids]


def decide(candidate: list[float], baseline: list[float], *, threshold: float, alpha: float = 0.025,
           min_prompts: int = 8) -> Decision:
    """Promote or refuse ``candidate`` against ``baseline`` (per-prompt values, paired by position)."""
    check_rule(threshold, alpha, min_prompts)
    if len(candidate) != len(baseline):
        raise ValueError(f"{len(candidate)} candidate values against {len(baseline)} baseline values: not paired")
    n = len(candidate)
    if n < min_prompts:
        return Decision(False, f"{n} paired prompts; at least {min_prompts} are needed to tell a gain from noise", n,
                        _mean(candidate), _mean(baseline), 0.0, 0.0, threshold, alpha, 0.0)
    diffs = [c - b for c, b in zip(candidate, baseline)]
    mean = _mean(diffs)
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n)
    q = t_quantile(alpha, n)
    figures = dict(prompts=n, mean_candidate=_mean(candidate), mean_baseline=_mean(baseline), mean_difference=mean,
                   standard_error=se, threshold=threshold, alpha=alpha, t_quantile=q)
    if mean <= threshold:
        return Decision(False, f"mean gain {mean:.4g} is not above the threshold {threshold:.4g}", **figures)
    if mean <= q * se:
        return Decision(False, f"mean gain {mean:.4g} is within the noise (t quantile {q:.3f} at {n - 1} degrees of "
                               f"freedom × standard error {se:.4g} = {q * se:.4g})", **figures)
    return Decision(True, f"mean gain {mean:.4g} is above the threshold {threshold:.4g} and t quantile {q:.3f} × "
                          f"standard error {se:.4g}", **figures)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
