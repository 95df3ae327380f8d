"""Counting τ (acceptance length) from the per-step records of :func:`dfp_trainer.evaluate.decode.verify_decode`.

* ``tau`` - the project's counting (the trainer's report uses it): tokens emitted per target verify
  step, over every step after the prefill; the emitted tokens are cut at the token budget and at a
  stop token, and a step without drafts emits one token.
* ``tau_vllm`` - vLLM's mean acceptance length: 1 + drafts accepted / steps that drafted, each
  verified block counted whole (drafts the target accepted past a stop token or the budget count;
  steps without drafts are left out, as vLLM records no draft for them).

:func:`tau_of` decodes a training run's prompts with its drafter and the run's settings.
"""

from __future__ import annotations

import torch
from dfp_shared.models.stop_tokens import stop_token_ids

from .acceptance import acceptance


def tau_figures(runs: list[dict], draft_len: int) -> dict:
    """Both countings of τ over decoding results (see the module docstring), the histogram of accepted
    drafts per step, and the acceptance of each draft position k (1..draft_len): the share of steps
    that drafted at least k tokens whose k-th draft was accepted."""
    steps = [s for r in runs for s in r["steps"]]
    accepted = [a for r in runs for a in r["accepted"]]
    drafted = [d for r in runs for d in r["drafted"]]
    hist = [0] * (draft_len + 1)
    for a in accepted:
        hist[a] += 1
    drafting = [(a, d) for a, d in zip(accepted, drafted) if d > 0]
    position = []
    for k in range(1, draft_len + 1):
        reached = [a for a, d in drafting if d >= k]
        position.append(sum(a >= k for a in reached) / len(reached) if reached else 0.0)
    return {"tau": sum(steps) / len(steps) if steps else 0.0,
            "tau_vllm": 1.0 + sum(a for a, _ in drafting) / len(drafting) if drafting else 1.0,
            "steps": len(steps), "new_tokens": sum(steps), "drafting_steps": len(drafting),
            "drafted_tokens": sum(drafted), "accepted_drafts": sum(accepted),
            "accepted_hist": hist, "position_acceptance": position}


def tau_of(setup, drafter, target, prompts: list[torch.Tensor]) -> dict:
    """:func:`~dfp_trainer.evaluate.acceptance.acceptance` of ``drafter`` on ``prompts`` with the run's decoding settings."""
    with torch.no_grad():
        return acceptance(drafter, target, prompts, max_new_tokens=setup.spec.eval_max_new_tokens,
                          stop_token_ids=stop_token_ids(setup.tokenizer), layer_ids=setup.layer_ids)
