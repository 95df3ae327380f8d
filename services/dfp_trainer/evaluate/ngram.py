"""N-gram (prompt-lookup) speculation: the baseline a user gets without training a drafter.

Proposal rule (the rule of vLLM's ``ngram`` method, with ``prompt_lookup_max`` / ``prompt_lookup_min``):
for n from ``max_n`` down to ``min_n``, take the last n tokens of the sequence (prompt + tokens emitted so
far) and look for an earlier occurrence of them; the longest n that occurs wins, and of its occurrences
the earliest. The proposal is the tokens that follow that occurrence, at most the draft length (fewer
when the occurrence lies near the end); no occurrence of any n means no drafts, and the step is a
plain decoding step (the target emits one token).

The drafts are verified greedily by the target in the same harness as DFlash
(:func:`dfp_trainer.evaluate.decode.verify_decode`), so the output is the target's greedy output and τ is
counted the same way. Two countings of τ (:func:`dfp_trainer.evaluate.tau.tau_figures` computes both):

* ``tau`` - the project's: tokens emitted per target verify step, over every step after the prefill
  (a step without drafts emits one token); the emitted tokens are cut at the token budget and at a
  stop token.
* ``tau_vllm`` - vLLM's mean acceptance length: 1 + drafts accepted / steps that drafted, counting
  each verified block whole (drafts the target accepted past a stop token or the budget count too;
  steps without drafts are not counted, as vLLM records no draft for them).
"""

from __future__ import annotations

import torch

from .decode import Proposer, StopCheck, verify_decode


def propose_ngram(seq: list[int] | torch.Tensor, k: int, min_n: int, max_n: int) -> list[int]:
    """At most ``k`` tokens following the earliest earlier occurrence of the longest suffix of ``seq``
    whose length is in ``min_n..max_n``; empty when no such suffix occurs earlier."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    ids = torch.as_tensor(seq, dtype=torch.long).flatten()
    total = ids.shape[0]
    if k <= 0:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = ids[total - n:]
        windows = ids[: total - 1].unfold(0, n, 1)  # starts 0..total-1-n: every occurrence but the suffix itself
        hits = torch.nonzero((windows == suffix).all(dim=1)).flatten()
        if hits.numel():
            after = int(hits[0]) + n
            return ids[after:after + k].tolist()
    return []


def ngram_proposer(min_n: int, max_n: int) -> Proposer:
    """:func:`propose_ngram` as a proposer of the decoding harness (it reads no target features)."""

    def propose(seq: torch.Tensor, context, n: int) -> torch.Tensor:
        return torch.tensor(propose_ngram(seq, n, min_n, max_n), dtype=torch.long)

    return propose


def ngram_decode(target, prompt_ids: torch.Tensor, *, draft_len: int, max_new_tokens: int, min_n: int, max_n: int,
                 stop_token_ids=(), whole_blocks: bool = True, use_cache: bool | None = None,
                 should_stop: StopCheck | None = None) -> dict:
    """Greedy n-gram speculative decoding of one prompt: :func:`~dfp_trainer.evaluate.decode.verify_decode`'s result."""
    return verify_decode(ngram_proposer(min_n, max_n), target, prompt_ids, max_new_tokens=max_new_tokens,
                         draft_len=draft_len, layer_ids=(), stop_token_ids=stop_token_ids, use_cache=use_cache,
                         whole_blocks=whole_blocks, should_stop=should_stop)
