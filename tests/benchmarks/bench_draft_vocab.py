"""Benchmark: the drafter's training step with the target's full LM head beside a pruned draft vocabulary, per
drafter family.

At Qwen3's 151,936-token vocabulary the frozen LM head is the largest single cost of a drafter step: two
GEMMs (logits, and the gradient of the hidden states) and a softmax over every row. A pruned vocabulary
(``draft_vocab_size``) keeps only its rows. Same drafter layers, same batch, same anchors; every label lies in
the smallest vocabulary, so each variant trains the same positions. The step is the trainer's: the DFlash
loss forward and backward, clip 1.0, AdamW. Rounds interleave the variants (one step each) and each one's
median counts.

* baseline - the full head (151,936 rows);
* project  - a 32,768-row draft vocabulary (the public Qwen3-8B drafter's size); 8,192 rows beside it;
* limit    - a 64-row vocabulary: the head's cost nearly gone, what the rest of the step costs.

Each family other than DFlash (``--families``) steps at every size it takes too (DFlash2 the full head only),
in the same rounds: its heads' cost beside DFlash's at the same vocabulary (``vs_dflash``).

Run: ``python tests/benchmarks/bench_draft_vocab.py [--hidden 256] [--steps 3]``; the last line is JSON.
:func:`draft_vocab_steps` is also the GPU check's ``draft_vocab`` stage, at the check's shapes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common  # noqa: F401 - import path
import torch
from _common import report
from dfp_trainer.drafter.batch import Batch
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.families import build_drafter
from dfp_trainer.drafter.objective import dflash_loss
from torch import nn

QWEN3_VOCAB = 151_936
SIZES = (None, 32_768, 8_192, 64)  # None: the target's full head
# each family's own drafter config fields (the family follows from them), at the spec's defaults
FAMILIES = {"dflash": {}, "dspark": {"markov_rank": 32, "confidence_head": True},
            "dflash2": {"conv_kernel_size": 4, "conv_group_size": 64, "selector_rank": 64, "selector_top_k": 8}}
UNPRUNED = {"dflash2"}  # vLLM's DFlash2 drafts LM-head rows as target ids: no pruned vocabulary


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def draft_vocab_steps(embed: nn.Embedding, head: nn.Linear, *, layers: int, heads: int, kv_heads: int,
                      head_dim: int, intermediate: int, block: int, anchors: int, tokens: int, sequences: int = 1,
                      steps: int = 3, warmup: int = 1, sizes=SIZES, families=("dflash",),
                      device: torch.device | None = None) -> dict:
    """Tokens/s of the drafter's training step over ``embed``/``head`` (the target's) per draft vocabulary
    size (``None``: the full head; sizes not below the head's rows are skipped), and each one's speed-up over
    DFlash's full head. DFlash's rows are keyed by size (``full``, ``32768``, ...), another family's by
    ``family:size``, with ``vs_dflash`` its step time against DFlash's at that size."""
    device = device or head.weight.device
    vocab, hidden = head.weight.shape
    smallest = min(s for s in sizes if s) if any(sizes) else vocab
    g = torch.Generator().manual_seed(0)
    width = hidden * layers
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch = Batch(input_ids=torch.randint(0, smallest, (sequences, tokens), generator=g, dtype=torch.int32),
                  loss_mask=torch.ones(sequences, tokens, dtype=torch.uint8),
                  lengths=torch.full((sequences,), tokens),
                  target_hidden=torch.randn(sequences, tokens, width, generator=g).to(dtype)).to(device)
    out: dict = {"vocab": vocab, "hidden": hidden, "rows_per_step": sequences * anchors * (block - 1)}
    variants = {}
    for family in families:
        for size in sizes:
            if size is not None and (size >= vocab or family in UNPRUNED):
                continue
            config = DrafterConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                   rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=max(4096, 2 * tokens),
                                   vocab_size=vocab, num_target_layers=layers + 4,
                                   target_layer_ids=list(range(1, layers + 1)), mask_token_id=vocab - 2,
                                   block_size=block, draft_vocab_size=size, **FAMILIES[family])
            torch.manual_seed(0)
            drafter = build_drafter(config, embed, head, None if size is None else torch.arange(size)).to(device)
            params = drafter.trainable_parameters()
            name = str(size or "full") if family == "dflash" else f"{family}:{size or 'full'}"
            variants[name] = (drafter, params, torch.optim.AdamW(params, lr=6e-4))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(warmup + steps):  # rounds interleave the variants: a shared machine's load falls on all alike
        for name, (drafter, params, optim) in variants.items():
            _sync(device)
            t0 = time.perf_counter()
            loss, _ = dflash_loss(drafter, batch, max_anchors=anchors, gamma=7.0,
                                  generator=torch.Generator().manual_seed(i))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            optim.zero_grad(set_to_none=True)
            _sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    for name, spent in times.items():
        step_s = statistics.median(spent)
        out[name] = {"step_s": step_s, "tokens_per_s": sequences * tokens / step_s}
    del variants
    full = out["full"]["step_s"]
    out["speedup"] = {k: full / v["step_s"] for k, v in out.items() if isinstance(v, dict) and "step_s" in v}
    for name in times:
        if ":" in name:
            out[name]["vs_dflash"] = out[name.split(":", 1)[1]]["step_s"] / out[name]["step_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of the target's head and the drafter")
    ap.add_argument("--layers", type=int, default=1, help="draft layers")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--anchors", type=int, default=64, help="anchors per sequence (the head's rows: anchors x (block - 1))")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated families (of {list(FAMILIES)})")
    ap.add_argument("--steps", type=int, default=5, help="timed rounds (one step of each vocabulary) after a warm-up "
                                                      "round; each vocabulary's median counts")
    args = ap.parse_args()
    torch.manual_seed(0)
    embed = nn.Embedding(QWEN3_VOCAB, args.hidden).requires_grad_(False)
    head = nn.Linear(args.hidden, QWEN3_VOCAB, bias=False).requires_grad_(False)
    heads = max(1, args.hidden // 64)
    figures = draft_vocab_steps(embed, head, layers=args.layers, heads=heads, kv_heads=max(1, heads // 2), head_dim=64,
                                intermediate=3 * args.hidden, block=args.block, anchors=args.anchors,
                                tokens=args.tokens, sequences=args.sequences, steps=args.steps,
                                families=tuple(f for f in args.families.split(",") if f))
    for key, row in figures.items():
        if not isinstance(row, dict) or "step_s" not in row:
            continue
        family, size = key.split(":") if ":" in key else ("dflash", key)
        versus = f", {row['vs_dflash']:.2f}x DFlash's step" if "vs_dflash" in row else ""
        print(f"{family:>7} draft vocabulary {size:>6}: {row['step_s'] * 1e3:8.1f} ms/step, "
              f"{row['tokens_per_s']:8,.0f} tok/s, {figures['speedup'][key]:.2f}x DFlash's full head{versus}")
    report("draft_vocab", "tokens/s", figures["32768"]["tokens_per_s"], baseline=figures["full"]["tokens_per_s"],
           limit=figures["64"]["tokens_per_s"], vocab=QWEN3_VOCAB, hidden=args.hidden,
           rows_per_step=figures["rows_per_step"],
           tokens_per_s_8192=round(figures["8192"]["tokens_per_s"], 1),
           speedup_32768=round(figures["speedup"]["32768"], 3), speedup_8192=round(figures["speedup"]["8192"], 3),
           families={k: {"tokens_per_s": round(v["tokens_per_s"], 1), "vs_dflash": round(v["vs_dflash"], 3)}
                     for k, v in figures.items() if isinstance(v, dict) and "vs_dflash" in v})


if __name__ == "__main__":
    main()
