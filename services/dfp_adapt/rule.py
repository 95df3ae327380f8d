"""When a candidate drafter replaces the served one: its τ must beat the served drafter's beyond the noise.

Both drafters are evaluated on the same held-out prompts (the newest traffic), so the comparison is paired:
for each prompt the difference ``d_i = τ_candidate,i - τ_served,i``. With ``n`` prompts, the mean ``d̄`` and
its standard error ``se = s_d / sqrt(n)`` (``s_d`` the sample standard deviation of the differences), the
candidate is promoted only when

    d̄ > threshold   and   d̄ > z · se

that is, it is better by at least the operator's margin and the gain is ``z`` standard errors away from zero
(``z`` 1.96: a one-sided test at about 2.5 %). Fewer than ``MIN_PROMPTS`` paired prompts, or no spread at all
with no gain, decide nothing: the candidate is refused. With no drafter served yet, the baseline is n-gram
speculation's τ on the same prompts: a first drafter must beat what serving without one gives.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

MIN_PROMPTS = 2
MAX_THRESHOLD = 16.0  # τ is at most the block size, which a train spec bounds
MAX_Z = 10.0


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    prompts: int  # paired prompts compared
    tau_candidate: float
    tau_baseline: float
    mean_difference: float
    standard_error: float
    threshold: float
    z: float

    def as_dict(self) -> dict:
        return asdict(self)


def check_rule(threshold: float, z: float) -> None:
    """The rule's own numbers, bounded (raises ValueError naming the one out of range)."""
    if not (math.isfinite(threshold) and 0.0 <= threshold <= MAX_THRESHOLD):
        raise ValueError(f"threshold {threshold}: expected 0..{MAX_THRESHOLD} (τ, tokens per verify step)")
    if not (math.isfinite(z) and 0.0 <= z <= MAX_Z):
        raise ValueError(f"z {z}: expected 0..{MAX_Z} (standard errors)")


def paired(candidate: dict[str, float], baseline: dict[str, float]) -> tuple[list[float], list[float]]:
    """The τ of the prompts both evaluations hold with a finite τ (by prompt id, in id order)."""
    ids = sorted(i for i in set(candidate) & set(baseline) if math.isfinite(candidate[i]) and math.isfinite(baseline[i]))
    return [candidate[i] for i in ids], [baseline[i] for i in ids]


def decide(candidate: list[float], baseline: list[float], *, threshold: float, z: float = 1.96) -> Decision:
    """Promote or refuse ``candidate`` against ``baseline`` (per-prompt τ, paired by position)."""
    check_rule(threshold, z)
    if len(candidate) != len(baseline):
        raise ValueError(f"{len(candidate)} candidate τ against {len(baseline)} baseline τ: not paired")
    n = len(candidate)
    if n < MIN_PROMPTS:
        return Decision(False, f"{n} paired prompts; at least {MIN_PROMPTS} are needed to measure the noise", n,
                        _mean(candidate), _mean(baseline), 0.0, 0.0, threshold, z)
    diffs = [c - b for c, b in zip(candidate, baseline)]
    mean = _mean(diffs)
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n)
    figures = dict(prompts=n, tau_candidate=_mean(candidate), tau_baseline=_mean(baseline), mean_difference=mean,
                   standard_error=se, threshold=threshold, z=z)
    if mean <= threshold:
        return Decision(False, f"mean τ gain {mean:.4f} is not above the threshold {threshold}", **figures)
    if mean <= z * se:
        return Decision(False, f"mean τ gain {mean:.4f} is within the noise ({z} × standard error {se:.4f} = "
                               f"{z * se:.4f})", **figures)
    return Decision(True, f"mean τ gain {mean:.4f} is above the threshold {threshold} and {z} × standard error "
                          f"{se:.4f}", **figures)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
