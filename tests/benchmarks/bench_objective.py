"""Benchmark: the DFlash objective's forward + backward, in draft blocks trained per second.

Same drafter, same batch, same sampled anchors, three ways:

* project  - ``dflash_loss``: every block of the batch in one attention call under the block mask
  (each block sees the context strictly before its anchor and its own block), logits in chunks;
* baseline - the naive way: one drafter forward per block with the context cut at its anchor (as
  the decoding loop does), full logits, losses summed, one backward;
* limit    - the project's batched call with the mask dropped (plain dense SDPA over the same keys):
  the same arithmetic minus the masking, the floor the batched path can reach.

Rounds interleave the three and each one's median counts. Figures: blocks/s (higher is better).
Run: ``python tests/benchmarks/bench_objective.py [--rounds 3] [--seq-len 384] [--anchors 16]``;
the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "services"), str(ROOT)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from dfp_trainer.drafter import objective  # noqa: E402
from dfp_trainer.drafter.batch import Batch  # noqa: E402
from dfp_trainer.drafter.config import DrafterConfig  # noqa: E402
from dfp_trainer.drafter.model import DFlashDrafter  # noqa: E402
from dfp_trainer.drafter.objective import block_targets, dflash_loss, sample_anchors  # noqa: E402
from torch import nn  # noqa: E402


def build(vocab: int, hidden: int, block: int) -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=1,
                        num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64, head_dim=32,
                        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=8192, vocab_size=vocab,
                        num_target_layers=8, target_layer_ids=[4], mask_token_id=vocab - 1, block_size=block)
    return DFlashDrafter(cfg, nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab, bias=False))


def naive_loss(drafter, ids, loss_mask, feats, lengths, anchors, valid, gamma=7.0):
    """One forward per block over the context before its anchor; the straightforward implementation."""
    cfg = drafter.config
    b = cfg.block_size
    labels, weights = block_targets(ids, loss_mask, lengths, anchors, valid, b, gamma)
    total = 0.0
    for s in range(ids.shape[0]):
        for n in range(anchors.shape[1]):
            if not valid[s, n]:
                continue
            a = int(anchors[s, n])
            block = torch.full((1, b), cfg.mask_token_id)
            block[0, 0] = ids[s, a]
            hidden = drafter(block, (a + torch.arange(b))[None], feats[s:s + 1, :a], torch.arange(a), None)
            ce = F.cross_entropy(drafter.logits(hidden[0]), labels[s, n], reduction="none")
            total = total + (ce * weights[s, n]).sum()
    return total / weights.sum()


def timed(fn) -> float:
    start = time.perf_counter()
    loss = fn()
    loss.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=384)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--anchors", type=int, default=16, help="anchors per sequence")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--block", type=int, default=16)
    args = parser.parse_args()

    drafter = build(args.vocab, args.hidden, args.block)
    g = torch.Generator().manual_seed(0)
    s, t = args.batch, args.seq_len
    ids = torch.randint(0, args.vocab - 1, (s, t), generator=g)
    loss_mask = torch.ones(s, t)
    loss_mask[:, : t // 8] = 0
    feats = torch.randn(s, t, args.hidden, generator=g)
    lengths = torch.full((s,), t)
    anchors, valid = sample_anchors(loss_mask, lengths, args.anchors, torch.Generator().manual_seed(1))
    blocks = int(valid.sum())
    batch = Batch(ids, loss_mask, lengths, target_hidden=feats)

    def project():
        return dflash_loss(drafter, batch, max_anchors=args.anchors,
                           generator=torch.Generator().manual_seed(1), attention_backend="sdpa")[0]

    def limit():
        real = objective.training_masks
        objective.training_masks = lambda *a, **k: None  # dense attention: no mask at all
        try:
            return project()
        finally:
            objective.training_masks = real

    def baseline():
        return naive_loss(drafter, ids, loss_mask, feats, lengths, anchors, valid)

    with torch.no_grad():
        ref, naive = project().item(), baseline().item()
    same = abs(ref - naive) < 1e-3 * max(1.0, abs(ref))
    times = {"project": [], "baseline": [], "limit": []}
    for _ in range(args.rounds):
        for name, fn in (("project", project), ("baseline", baseline), ("limit", limit)):
            drafter.zero_grad(set_to_none=True)
            times[name].append(timed(fn))
    rate = {k: blocks / statistics.median(v) for k, v in times.items()}
    print(f"blocks per batch {blocks}; median seconds per forward+backward: "
          + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in times.items()))
    print(json.dumps({"benchmark": "objective", "unit": "blocks/s", "project": round(rate["project"], 1),
                      "baseline": round(rate["baseline"], 1), "limit": round(rate["limit"], 1),
                      "vs_baseline": round(rate["project"] / rate["baseline"], 2),
                      "vs_limit": round(rate["project"] / rate["limit"], 3), "same_loss": same,
                      "seq_len": t, "batch": s, "blocks": blocks, "block_size": args.block, "vocab": args.vocab,
                      "hidden": args.hidden, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
