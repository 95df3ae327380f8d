"""Input pipeline data side: the token dataset in memory, length-bucketed batches, a resumable sampler.

The whole tokenized dataset is read once (``dfp_shared.records.token_shards.load_dataset``: manifest ->
shards -> three flat tensors). Batches are index tensors planned per epoch with tensor ops:

1. a permutation of all samples from ``(seed, epoch)``;
2. windows of that permutation sorted by length (length bucketing keeps padding small while the
   order stays random across windows);
3. greedy packing under a padded-token budget (``batch_size * longest <= tokens_per_batch``), the
   batch size rounded down to a multiple of ``divisor`` (ranks x accumulation steps) so every rank
   gets the same number of samples;
4. the batch order shuffled again.

Collation (:func:`~.collate.collate`, into the drafter's :class:`~dfp_trainer.drafter.batch.Batch`) copies
each sample's contiguous slice of the flat buffers into the padded ``(B, T)`` tensors; no per-token Python
work.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from dfp_shared.records.token_shards import TokenDataset, load_dataset

log = logging.getLogger(__name__)


class DataError(ValueError):
    """The dataset cannot be trained on (empty, wrong tokenizer, ...); the message says why."""


def load_training_data(uri: str, *, endpoint_url: str | None = None,
                       tokenizer_fingerprint: str | tuple[str, ...] | None = None,
                       chat_template_fingerprint: str | None = None, min_tokens: int = 2) -> TokenDataset:
    """Load a dataset and check it can be trained on; raises :class:`DataError` naming the problem.

    ``tokenizer_fingerprint`` may list several accepted fingerprints (the target tokenizer with and
    without the added mask token, which encodes text identically)."""
    try:
        ds = load_dataset(uri, endpoint_url=endpoint_url)
    except ValueError as exc:  # DatasetError: missing manifest, checksum, format
        raise DataError(str(exc)) from None
    check_dataset(ds, uri, tokenizer_fingerprint=tokenizer_fingerprint,
                  chat_template_fingerprint=chat_template_fingerprint, min_tokens=min_tokens)
    return ds


def check_dataset(ds: TokenDataset, uri: str, *, tokenizer_fingerprint: str | tuple[str, ...] | None = None,
                  chat_template_fingerprint: str | None = None, min_tokens: int = 2) -> None:
    if ds.num_samples == 0:
        raise DataError(f"{uri}: the dataset is empty (manifest lists {len(ds.manifest.get('shards', []))} shards, "
                        "0 samples); nothing to train on")
    accepted = (tokenizer_fingerprint,) if isinstance(tokenizer_fingerprint, str) else tokenizer_fingerprint
    if accepted and ds.tokenizer_fingerprint and ds.tokenizer_fingerprint not in accepted:
        raise DataError(f"{uri}/manifest.json: field tokenizer_fingerprint is {ds.tokenizer_fingerprint!r} but the "
                        f"target's tokenizer has {accepted[0]!r}: the dataset was tokenized with another "
                        "tokenizer; re-tokenize it with the target's tokenizer")
    if chat_template_fingerprint and ds.chat_template_fingerprint and \
            ds.chat_template_fingerprint != chat_template_fingerprint:
        log.warning("dataset chat template differs from the target tokenizer's",
                    extra={"dataset": uri, "dataset_template": ds.chat_template_fingerprint,
                           "target_template": chat_template_fingerprint})
    trainable = trainable_samples(ds, min_tokens)
    if int(trainable.sum()) == 0:
        raise DataError(f"{uri}: no sample has {min_tokens} or more tokens with two consecutive trained "
                        "positions (loss mask is empty); nothing to train on")


def trainable_samples(ds: TokenDataset, min_tokens: int = 2) -> torch.Tensor:
    """(S,) bool: samples long enough and with at least one pair of consecutive loss-masked tokens."""
    mask = ds.loss_mask.to(torch.int64)
    pair = torch.zeros_like(mask)
    pair[:-1] = mask[:-1] * mask[1:]
    csum = torch.zeros(mask.numel() + 1, dtype=torch.int64)
    torch.cumsum(pair, 0, out=csum[1:])
    ends = (ds.offsets[1:] - 1).clamp(min=0)  # a pair must start before the sample's last token
    pairs = csum[ends] - csum[ds.offsets[:-1]]
    return (ds.lengths >= min_tokens) & (pairs > 0)


def plan_epoch(lengths: torch.Tensor, tokens_per_batch: int, *, seed: int, epoch: int, divisor: int = 1,
               window: int = 64) -> list[torch.Tensor]:
    """The batches of one epoch: a list of sample-index tensors, deterministic in (seed, epoch).

    ``lengths`` are the (already capped) sample lengths; samples of length 0 should be excluded by
    the caller. Each batch's padded size ``len(batch) * max(lengths[batch])`` stays within
    ``tokens_per_batch`` unless one group of ``divisor`` samples alone exceeds it.
    """
    n = lengths.numel()
    if n == 0:
        return []
    gen = torch.Generator().manual_seed(_mix(seed, epoch))
    perm = torch.randperm(n, generator=gen)
    # length bucketing: sort each window of `window * divisor * typical batch` samples, longest first
    typical = max(1, tokens_per_batch // max(1, int(lengths.float().mean().item())))
    span = max(divisor, window * typical)
    pad = (-n) % span
    keys = lengths[perm].to(torch.int64)
    if pad:
        keys = torch.cat([keys, torch.full((pad,), -1, dtype=torch.int64)])
        perm = torch.cat([perm, torch.full((pad,), -1, dtype=torch.int64)])
    order = torch.argsort(keys.view(-1, span), dim=1, descending=True, stable=True)
    sorted_idx = torch.gather(perm.view(-1, span), 1, order).flatten()
    sorted_idx = sorted_idx[sorted_idx >= 0]
    sorted_len = lengths[sorted_idx].tolist()
    batches = []
    i = 0
    while i < n:
        longest = sorted_len[i]  # longest first within a window, so the head of a batch is its max
        size = max(divisor, (tokens_per_batch // max(1, longest)) // divisor * divisor)
        j = min(n, i + size)
        # a window boundary may bring a longer sample: shrink until the budget holds
        while j - i > divisor and (j - i) * max(sorted_len[i:j]) > tokens_per_batch:
            j = i + max(divisor, ((j - i) // 2) // divisor * divisor)
        if j - i < divisor:  # the tail: fewer samples than ranks x micro-batches; dropped this epoch
            break
        batches.append(sorted_idx[i:j])
        i = j
    shuffle = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[k] for k in shuffle]


def _mix(seed: int, *parts: int) -> int:
    h = seed & 0xFFFFFFFF
    for p in parts:
        h = (h * 1_000_003 + int(p) + 0x9E3779B9) & 0x7FFFFFFFFFFFFFFF
    return h


def step_seed(seed: int, step: int, shard: int) -> int:
    """The seed of one micro-batch's randomness (anchors, noise): a pure function of its place in training."""
    return _mix(seed, 7919, step, shard)


class BatchSampler:
    """Global batches epoch after epoch, resumable: ``state_dict()`` is (epoch, position in the epoch).

    Every rank builds the same plan; :func:`rank_share` picks each rank's part of a batch.
    """

    def __init__(self, lengths: torch.Tensor, tokens_per_batch: int, *, seed: int = 0, divisor: int = 1,
                 window: int = 64, eligible: torch.Tensor | None = None):
        if tokens_per_batch <= 0:
            raise ValueError("tokens_per_batch must be positive")
        self.lengths = lengths.to(torch.int64)
        self.tokens_per_batch = tokens_per_batch
        self.seed = seed
        self.divisor = divisor
        self.window = window
        keep = self.lengths > 0 if eligible is None else eligible & (self.lengths > 0)
        self.pool = torch.nonzero(keep).flatten()
        if self.pool.numel() < divisor:
            raise DataError(f"{self.pool.numel()} trainable samples cannot fill one batch of {divisor} "
                            "(ranks x accumulation steps)")
        self.epoch = 0
        self.position = 0
        self._plan: list[torch.Tensor] | None = None
        self._plan_epoch = -1

    def _epoch_plan(self, epoch: int) -> list[torch.Tensor]:
        if self._plan_epoch != epoch:
            local = plan_epoch(self.lengths[self.pool], self.tokens_per_batch, seed=self.seed, epoch=epoch,
                               divisor=self.divisor, window=self.window)
            self._plan = [self.pool[b] for b in local]
            self._plan_epoch = epoch
        return self._plan

    def batches_per_epoch(self) -> int:
        return len(self._epoch_plan(0))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, dict]]:
        """Yields ``(indices, state_after)``; ``state_after`` resumes right after this batch."""
        while True:
            plan = self._epoch_plan(self.epoch)
            if not plan:
                raise DataError("an epoch produced no batch; lower the number of ranks or raise tokens_per_batch")
            while self.position < len(plan):
                idx = plan[self.position]
                self.position += 1
                yield idx, self.state_dict()
            self.epoch += 1
            self.position = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "tokens_per_batch": self.tokens_per_batch, "divisor": self.divisor}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "tokens_per_batch", "divisor"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"checkpoint sampler {key}={state[key]} differs from this run's {getattr(self, key)}; "
                                 "resume with the same settings")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def rank_share(indices: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s part of a global batch: every ``world_size``-th sample (the batch is sorted by
    length, so the parts are balanced in tokens)."""
    return indices[rank::world_size]


def micro_batches(indices: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Split one rank's share into ``parts`` accumulation steps (interleaved, balanced in length)."""
    return [indices[k::parts] for k in range(parts)]
