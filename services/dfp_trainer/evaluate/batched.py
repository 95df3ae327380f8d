"""Draft-and-verify decoding of several prompts at once, with the one-at-a-time decoder's outputs and counts.

:func:`verify_decode_batch` runs :func:`.decode.verify_decode`'s loop for a batch of prompts: each step
every unfinished row drafts (its own proposer, or one drafter forward for the whole batch) and the
target verifies every row's ``[anchor, drafts]`` in one forward. The rows share one KV cache: a step
appends one chunk of slots to every row (its tokens, right-padded to the longest), and the slots a row
does not keep (padding, rejected drafts) stay masked out of every later forward; each token carries
its own position id, so a row's tokens see exactly the keys they see alone.

Exactly the same decisions, by a guard. A padded batched forward differs from a row's forward alone in
the last bits, which could flip an argmax whose top two logits (nearly) tie. So every decision a row
consumes (the target's token at each verified position up to its first disagreement and the bonus; the
drafter's token at each draft up to and including the first rejected one) must win by at least
``tie_margin`` (logits); a row with a closer decision leaves the batch and is decoded again alone by
:func:`.decode.verify_decode`. While the batched and the lone logits differ by less than half the margin
(float32: a few ulps, often none, against the default 1e-4), every kept decision is the lone decoder's, so the outputs,
steps and histograms equal the one-at-a-time decoder's to the count; the result says how many rows
were decoded again (``recomputed``).

``should_stop`` is asked before every step of the batch and of each row decoded again alone, as
:func:`.decode.verify_decode` asks it: when it turns true the whole call ends with
:class:`.decode.DecodeStopped`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..drafter.attention import batch_decode_masks
from .decode import (
    Proposer,
    StopCheck,
    _has_linear_layers,
    check_stop,
    dflash_proposer,
    target_features,
    verify_decode,
)
from .ngram import ngram_proposer

TIE_MARGINS = {torch.float32: 1e-4, torch.float64: 1e-9}
"""Default ``tie_margin`` per logits dtype; lower precisions (bf16, fp16) use :data:`LOW_PRECISION_MARGIN`."""
LOW_PRECISION_MARGIN = 0.25

BatchProposer = Callable[[list[tuple[torch.Tensor, "torch.Tensor | None", int]]],
                         list[tuple[torch.Tensor, torch.Tensor]]]
"""``propose([(seq, context, n), ...])``: per row, at most ``n`` draft tokens after ``seq`` (as a
:data:`.decode.Proposer`'s) and the margin (logits) each draft won by (``inf`` for a rule without logits)."""


def _top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax and how far its logit leads the second (rows, V) -> (rows,), (rows,); inf with one column.
    An exact tie has a zero lead, so whichever of the tied ids is returned, the guard sends the row back."""
    if logits.shape[-1] < 2:
        return logits.argmax(-1), torch.full(logits.shape[:-1], float("inf"), device=logits.device)
    top = logits.float().topk(2, dim=-1)
    return top.indices[..., 0], top.values[..., 0] - top.values[..., 1]


def draft_with_margins(drafter, logits: torch.Tensor, hidden: torch.Tensor,
                       anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``drafter.draft(hidden, anchor)`` from its logits (n, V_d), and the margin each draft won by (n,), with each
    family's score: DFlash, the argmax of the logits; DSpark, of the logits plus the Markov head of the previous
    token, left to right; DFlash2, its selector's walk over the top-k candidates (the margin is also the k-th
    candidate's lead over the first one left out)."""
    if hasattr(drafter, "candidate_selector"):  # DFlash2
        k = drafter.config.selector_top_k
        values, ids = logits.float().topk(min(k + 1, logits.shape[-1]), dim=-1)
        edge = values[:, k - 1] - values[:, k] if values.shape[-1] > k else torch.full_like(values[:, 0], float("inf"))
        prev, drafts, gaps = anchor.reshape(1).long(), [], []
        for i in range(logits.shape[0]):
            best, gap = _top2(values[i : i + 1, :k] + drafter.candidate_selector(hidden[i : i + 1], prev, ids[i : i + 1, :k]))
            prev = ids[i : i + 1].gather(1, best[:, None])[:, 0]
            drafts.append(prev)
            gaps.append(torch.minimum(gap, edge[i : i + 1]))
        return torch.cat(drafts), torch.cat(gaps)
    if hasattr(drafter, "markov_head"):  # DSpark
        base = logits.float()
        prev, drafts, gaps = anchor.reshape(1).long(), [], []
        for i in range(base.shape[0]):
            best, gap = _top2(base[i : i + 1] + drafter.markov_head(prev).float())
            prev = drafter.to_target(best)
            drafts.append(prev)
            gaps.append(gap)
        return torch.cat(drafts), torch.cat(gaps)
    best, gaps = _top2(logits)
    return drafter.to_target(best), gaps


def dflash_batch_proposer(drafter) -> BatchProposer:
    """The drafter as a batch proposer: one forward over every row's ``[anchor, mask * n]`` block after its own
    context (contexts and blocks padded; padding hidden from every real query) and one LM-head product, then
    the family's drafting per row (:func:`draft_with_margins`)."""
    cfg = drafter.config

    def propose(rows: list[tuple[torch.Tensor, torch.Tensor | None, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        dev = rows[0][0].device
        starts = [seq.shape[0] - 1 for seq, _, _ in rows]
        q_len = 1 + max(n for _, _, n in rows)
        c_len = max(starts)
        s = len(rows)
        block = torch.full((s, q_len), cfg.mask_token_id, dtype=torch.long, device=dev)
        context = rows[0][1].new_zeros(s, c_len, rows[0][1].shape[-1])  # (S, C, K*H)
        for i, (seq, ctx, _) in enumerate(rows):
            block[i, 0] = seq[-1]
            context[i, : starts[i]] = ctx
        anchors = torch.tensor(starts, device=dev)
        lens = torch.tensor([1 + n for _, _, n in rows], device=dev)
        positions = anchors[:, None] + torch.arange(q_len, device=dev)  # (S, Q)
        ctx_pos = torch.arange(c_len, device=dev).expand(s, -1)
        ctx_pos = torch.where(ctx_pos < anchors[:, None], ctx_pos, (anchors + q_len)[:, None])  # padding: after the block
        masks = batch_decode_masks(anchors, ctx_pos, lens, q_len, cfg.layer_types, cfg.sliding_window)
        hidden = drafter(block, positions, context, ctx_pos, masks)[:, 1:]  # (S, Q-1, H)
        logits = drafter.logits(hidden)  # (S, Q-1, V_d)
        return [draft_with_margins(drafter, logits[i, :n], hidden[i, :n], block[i, 0]) for i, (_, _, n) in enumerate(rows)]

    return propose


def row_proposer(propose: Proposer) -> BatchProposer:
    """A one-row proposer (e.g. n-gram lookup) as a batch proposer: each row drafted alone; a rule, so no margins."""

    def batch(rows):
        out = []
        for seq, ctx, n in rows:
            drafts = propose(seq, ctx, n)[:n].to(seq.device, torch.long)
            out.append((drafts, torch.full((drafts.shape[0],), float("inf"))))
        return out

    return batch


class _SharedCache:
    """Target forwards of a batch of growing sequences over one KV cache (see the module docstring).

    A forward returns each row's final hidden states, not its logits: the LM head (the costliest part of a small
    target) is applied by :func:`_verify` only where a decision is read. A target whose logits are not its LM
    head over those states (a soft cap, a scale) is found at the prefill and gets its logits from the forward."""

    def __init__(self, target, layer_ids: Sequence[int], batch: int, device) -> None:
        from transformers import DynamicCache

        self.target, self.layer_ids = target, list(layer_ids)
        self.cache = DynamicCache(config=target.config)
        self.cache_arg = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
        self.kept = torch.zeros(batch, 0, dtype=torch.bool, device=device)  # (B, slots): slot holds a known token
        self.head = target.get_output_embeddings()
        self.lazy = self.head is not None

    def forward(self, chunks: list[torch.Tensor], starts: list[int],
                prefill: bool = False) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per row: the states the LM head reads (n, H) (or its logits (n, V), see the class docstring) and the
        features (n, K*H) of its chunk (n tokens at positions ``start..``); a ``prefill`` row's logits (1, V) of its
        last token (the first decision)."""
        dev = self.kept.device
        width = max(c.shape[0] for c in chunks)
        ids = torch.zeros(len(chunks), width, dtype=torch.long, device=dev)
        real = torch.zeros(len(chunks), width, dtype=torch.bool, device=dev)
        for i, chunk in enumerate(chunks):
            ids[i, : chunk.shape[0]], real[i, : chunk.shape[0]] = chunk, True
        pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(width, device=dev)  # (B, L)
        lasts = sorted({c.shape[0] - 1 for c in chunks})
        keep = torch.tensor(lasts if prefill else [], dtype=torch.long, device=dev) if prefill or self.lazy else 0
        out = self.target(input_ids=ids, position_ids=pos, attention_mask=torch.cat([self.kept, real], 1).long(),
                          use_cache=True, output_hidden_states=True, logits_to_keep=keep, **{self.cache_arg: self.cache})
        self.kept = torch.cat([self.kept, torch.zeros_like(real)], dim=1)
        self._chunk = self.kept.shape[1] - width
        feats = target_features(out.hidden_states, self.layer_ids) if self.layer_ids else None  # (B, L, K*H)
        states = out.hidden_states[-1] if self.lazy and not prefill else out.logits  # (B, L, H) or (B, L, V)
        if prefill:
            states = torch.stack([out.logits[i, lasts.index(c.shape[0] - 1)] for i, c in enumerate(chunks)])[:, None]
            if self.lazy:  # the LM head over the final states must give the forward's logits
                last = torch.stack([out.hidden_states[-1][i, c.shape[0] - 1] for i, c in enumerate(chunks)])
                self.lazy = torch.allclose(self.head(last), states[:, 0], rtol=1e-5, atol=1e-5)
        return [(states[i, : c.shape[0]], feats[i, : c.shape[0]] if feats is not None else None)
                for i, c in enumerate(chunks)]

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Logits of rows of what :meth:`forward` returned."""
        return self.head(states) if self.lazy else states

    def keep(self, counts: list[int]) -> None:
        """Per row: how many leading slots of the last chunk hold tokens that stay (the others are masked out)."""
        for i, n in enumerate(counts):
            self.kept[i, self._chunk : self._chunk + n] = True

    def select(self, rows: list[int]) -> None:
        """Keep only these rows of the batch (in this order)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.kept.device)
        self.cache.batch_select_indices(index)
        self.kept = self.kept[index]


def _verify(shared: _SharedCache, drafts: list[torch.Tensor],
            states: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per row: the target's tokens at positions 0..a (a = drafts accepted: each draft equal to the target's token
    before it, then the first disagreement or the bonus) and the lead each won by. Position by position, one LM-head
    product for the rows still agreeing: a rejected block costs its first position, not the whole block."""
    tokens: list[list[int]] = [[] for _ in drafts]
    gaps: list[list[float]] = [[] for _ in drafts]
    active, j = list(range(len(drafts))), 0
    while active:
        best, gap = _top2(shared.logits(torch.stack([states[k][j] for k in active])))
        still = []
        for k, b, g in zip(active, best.tolist(), gap.tolist()):
            tokens[k].append(b)
            gaps[k].append(g)
            if j < drafts[k].shape[0] and int(drafts[k][j]) == b:
                still.append(k)
        active, j = still, j + 1
    return [(torch.tensor(t, dtype=torch.long, device=d.device), torch.tensor(g)) for t, g, d in zip(tokens, gaps, drafts)]


@dataclass
class _Row:
    index: int
    n_prompt: int
    seq: torch.Tensor
    context: torch.Tensor | None
    steps: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    hist: list[int] = field(default_factory=list)
    stopped: bool = False
    clear: bool = True  # every decision consumed so far won by the margin

    def result(self) -> dict:
        return {"new_ids": self.seq[self.n_prompt :].tolist(), "steps": self.steps, "accepted": self.accepted,
                "drafted": self.drafted, "accepted_hist": self.hist}


def _advance(row: _Row, drafts: torch.Tensor, draft_gaps: torch.Tensor, posterior: torch.Tensor, gaps: torch.Tensor,
             feats, *, max_len: int, stops: set[int], tie_margin: float) -> int:
    """One verify step's bookkeeping for a row (as :func:`.decode.verify_decode`'s loop) from :func:`_verify`'s
    tokens; returns the slots kept."""
    accepted = posterior.shape[0] - 1
    consumed = min(accepted + 1, drafts.shape[0])  # drafts up to and including the first rejected one
    if consumed and float(draft_gaps[:consumed].min()) < tie_margin:
        row.clear = False
    if float(gaps.min()) < tie_margin:
        row.clear = False
    row.hist[accepted] += 1
    new = torch.cat([drafts[:accepted], posterior[accepted : accepted + 1]])
    new = new[: max_len - row.seq.shape[0]]
    for i, tok in enumerate(new.tolist()):
        if tok in stops:
            new, row.stopped = new[: i + 1], True
            break
    row.seq = torch.cat([row.seq, new])
    if row.context is not None:
        row.context = torch.cat([row.context, feats[: new.shape[0]]])
    row.steps.append(int(new.shape[0]))
    row.accepted.append(accepted)
    row.drafted.append(int(drafts.shape[0]))
    return int(new.shape[0])


def _decode_group(propose: BatchProposer, target, prompts: list[torch.Tensor], indices: list[int], *,
                  max_new_tokens: int, draft_len: int, layer_ids: Sequence[int], stops: set[int],
                  whole_blocks: bool, tie_margin: float,
                  should_stop: StopCheck | None = None) -> tuple[dict[int, dict], list[int]]:
    """Decode one batch together; returns the results of rows whose every decision was clear, and the others."""
    check_stop(should_stop)
    dev = prompts[indices[0]].device
    shared = _SharedCache(target, layer_ids, len(indices), dev)
    outs = shared.forward([prompts[i] for i in indices], [0] * len(indices), prefill=True)
    rows = []
    for i, (logits, feats) in zip(indices, outs):
        first, gap = _top2(logits[-1:])
        row = _Row(i, prompts[i].shape[0], torch.cat([prompts[i], first]), feats, hist=[0] * (draft_len + 1))
        row.clear = float(gap[0]) >= tie_margin
        row.stopped = int(row.seq[-1]) in stops
        rows.append(row)
    shared.keep([r.n_prompt for r in rows])
    done, unclear = {}, []
    while True:
        live = []
        for k, r in enumerate(rows):
            if not r.clear:
                unclear.append(r.index)
            elif r.stopped or r.seq.shape[0] >= r.n_prompt + max_new_tokens:
                done[r.index] = r.result()
            else:
                live.append(k)
        if not live:
            return done, unclear
        check_stop(should_stop)
        if len(live) < len(rows):
            shared.select(live)
            rows = [rows[k] for k in live]
        starts = [r.seq.shape[0] - 1 for r in rows]
        rooms = [draft_len if whole_blocks else min(draft_len, r.n_prompt + max_new_tokens - s - 1)
                 for r, s in zip(rows, starts)]
        proposals = propose([(r.seq, r.context, n) for r, n in zip(rows, rooms)])
        drafts = [d[:n].to(dev, torch.long) for (d, _), n in zip(proposals, rooms)]
        outs = shared.forward([torch.cat([r.seq[s:], d]) for r, s, d in zip(rows, starts, drafts)], starts)
        verdicts = _verify(shared, drafts, [states for states, _ in outs])
        shared.keep([_advance(r, d, g, tokens, gaps, feats, max_len=r.n_prompt + max_new_tokens, stops=stops,
                              tie_margin=tie_margin)
                     for r, d, (_, g), (tokens, gaps), (_, feats) in zip(rows, drafts, proposals, verdicts, outs)])


def default_tie_margin(target) -> float:
    """:data:`TIE_MARGINS` for the target's dtype."""
    return TIE_MARGINS.get(next(target.parameters()).dtype, LOW_PRECISION_MARGIN)


@torch.inference_mode()
def verify_decode_batch(propose: BatchProposer, lone: Proposer, target, prompts: Sequence[torch.Tensor], *,
                        max_new_tokens: int, draft_len: int, batch_size: int, layer_ids: Sequence[int] = (),
                        stop_token_ids: Sequence[int] = (), whole_blocks: bool = False,
                        tie_margin: float | None = None, should_stop: StopCheck | None = None) -> tuple[list[dict], int]:
    """:func:`.decode.verify_decode` of every prompt (1-D ids), ``batch_size`` at a time (similar lengths together);
    ``lone`` is the same proposer for one row (the rows decoded again alone). Returns the per-prompt results in
    the prompts' order, and how many prompts were decoded again alone (a near tie, or a hybrid target)."""
    prompts = list(prompts)
    alone = dict(max_new_tokens=max_new_tokens, draft_len=draft_len, layer_ids=layer_ids,
                 stop_token_ids=stop_token_ids, whole_blocks=whole_blocks, should_stop=should_stop)
    if batch_size <= 1 or _has_linear_layers(target):  # recurrent state cannot be masked: one at a time
        return [verify_decode(lone, target, p, **alone) for p in prompts], 0
    margin = default_tie_margin(target) if tie_margin is None else tie_margin
    order = sorted(range(len(prompts)), key=lambda i: prompts[i].shape[0])
    results: dict[int, dict] = {}
    again: list[int] = []
    for b in range(0, len(order), batch_size):
        done, unclear = _decode_group(propose, target, prompts, order[b : b + batch_size],
                                      max_new_tokens=max_new_tokens, draft_len=draft_len, layer_ids=layer_ids,
                                      stops={int(t) for t in stop_token_ids}, whole_blocks=whole_blocks,
                                      tie_margin=margin, should_stop=should_stop)
        results.update(done)
        again += unclear
    for i in again:
        results[i] = verify_decode(lone, target, prompts[i], **alone)
    return [results[i] for i in range(len(prompts))], len(again)


def speculative_decode_batch(drafter, target, prompts: Sequence[torch.Tensor], *, max_new_tokens: int,
                             batch_size: int, layer_ids: Sequence[int] | None = None,
                             stop_token_ids: Sequence[int] = (), whole_blocks: bool = False,
                             tie_margin: float | None = None,
                             should_stop: StopCheck | None = None) -> tuple[list[dict], int]:
    """:func:`.decode.speculative_decode` of every prompt, ``batch_size`` at a time (see :func:`verify_decode_batch`)."""
    cfg = drafter.config
    layer_ids = list(layer_ids if layer_ids is not None else cfg.target_layer_ids)
    if len(layer_ids) != cfg.num_context_features:
        raise ValueError(f"{len(layer_ids)} layer ids given; the drafter was built for {cfg.num_context_features}")
    return verify_decode_batch(dflash_batch_proposer(drafter), dflash_proposer(drafter), target, prompts,
                               max_new_tokens=max_new_tokens, draft_len=cfg.block_size - 1, batch_size=batch_size,
                               layer_ids=layer_ids, stop_token_ids=stop_token_ids, whole_blocks=whole_blocks,
                               tie_margin=tie_margin, should_stop=should_stop)


def ngram_decode_batch(target, prompts: Sequence[torch.Tensor], *, draft_len: int, max_new_tokens: int, min_n: int,
                       max_n: int, batch_size: int, stop_token_ids: Sequence[int] = (),
                       whole_blocks: bool = True, should_stop: StopCheck | None = None) -> tuple[list[dict], int]:
    """:func:`.ngram.ngram_decode` of every prompt, ``batch_size`` at a time (see :func:`verify_decode_batch`)."""
    lone = ngram_proposer(min_n, max_n)
    return verify_decode_batch(row_proposer(lone), lone, target, prompts, max_new_tokens=max_new_tokens,
                               draft_len=draft_len, batch_size=batch_size, stop_token_ids=stop_token_ids,
                               whole_blocks=whole_blocks, should_stop=should_stop)
