"""Evaluation's decoding rate: evaluated tokens/s of the batched decoder, the one-at-a-time one, and plain greedy.

On the learnable target (:mod:`dfp_dev.targets.learnable`, built once and cached) with a DFlash drafter of the
evaluate job's shape (2 layers, block 8, untrained: every step verifies a whole block), the held-out prompts
are decoded as the ``evaluate`` job decodes them (greedy, blocks verified whole, stop tokens honoured):

* project - :func:`dfp_trainer.evaluate.batched.speculative_decode_batch`, ``--batch`` prompts at a time;
* baseline - :func:`dfp_trainer.evaluate.decode.speculative_decode`, one prompt at a time (the decoder before);
* limit - plain greedy decoding of the same target, ``model.generate`` over the same batches (left padded).

The batched decoder's outputs, steps and histograms must equal the one-at-a-time decoder's (the run fails
otherwise); n-gram speculation is timed both ways beside them. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import time

import _common  # noqa: F401  (import path)


def _greedy(target, tok, prompts, batch: int, max_new_tokens: int, stops: list[int]) -> int:
    """Tokens plain greedy decoding emits for the prompts, ``batch`` at a time (left padded), up to a stop token."""
    import torch

    emitted = 0
    for b in range(0, len(prompts), batch):
        group = prompts[b : b + batch]
        width = max(p.shape[0] for p in group)
        ids = torch.full((len(group), width), tok.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(group):
            ids[i, width - p.shape[0] :], mask[i, width - p.shape[0] :] = p, 1
        out = target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=stops, pad_token_id=tok.pad_token_id or 0)[:, width:]
        for row in out.tolist():
            cut = next((k + 1 for k, t in enumerate(row) if t in stops), len(row))
            emitted += cut
    return emitted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="Held-out prompts decoded.")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="Tokens per prompt.")
    ap.add_argument("--batch", type=int, default=8, help="Prompts decoded at once by the batched decoder.")
    ap.add_argument("--threads", type=int, default=1, help="Torch threads (one: a shared 2-core machine).")
    args = ap.parse_args()

    import torch
    from dfp_dev.targets.learnable import build_learnable_target, default_root
    from dfp_dev.targets.qwen3_tokenizer import qwen3_tokenizer_dir
    from dfp_shared.models.loading import load_causal_lm
    from dfp_shared.models.stop_tokens import stop_token_ids
    from dfp_shared.models.tokenizer_assets import load_tokenizer
    from dfp_shared.records.prompts import read_prompt_set
    from dfp_trainer.drafter.config import DrafterConfig
    from dfp_trainer.drafter.families import build_drafter
    from dfp_trainer.drafter.target_parts import load_target_parts, mask_token_id
    from dfp_trainer.evaluate.batched import ngram_decode_batch, speculative_decode_batch
    from dfp_trainer.evaluate.decode import chat_prompt_ids, speculative_decode
    from dfp_trainer.evaluate.ngram import ngram_decode
    from dfp_trainer.evaluate.tau import tau_figures

    torch.set_num_threads(args.threads)
    built = build_learnable_target(default_root(), qwen3_tokenizer_dir())
    tok = load_tokenizer(built.path)
    target = load_causal_lm(str(built.path), device="cpu")
    cfg = DrafterConfig.for_target(load_target_parts(built.path).config, num_layers=2, block_size=8,
                                   mask_token_id=mask_token_id(tok))
    torch.manual_seed(0)
    drafter = build_drafter(cfg, target.get_input_embeddings(), target.get_output_embeddings()).eval()
    records, _ = read_prompt_set(str(built.held_out_prompts), limit=args.prompts)
    prompts = [torch.tensor(chat_prompt_ids(tok, r.messages, True), dtype=torch.long) for r in records]
    stops = stop_token_ids(tok)
    kw = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=stops, whole_blocks=True)
    ngram_kw = dict(draft_len=7, max_new_tokens=args.max_new_tokens, min_n=1, max_n=4, stop_token_ids=stops)

    def timed(fn):
        began = time.perf_counter()
        with torch.inference_mode():
            out = fn()
        return out, time.perf_counter() - began

    lone, lone_s = timed(lambda: [speculative_decode(drafter, target, p, **kw) for p in prompts])
    (batched, again), batched_s = timed(lambda: speculative_decode_batch(drafter, target, prompts, batch_size=args.batch,
                                                                         **kw))
    if batched != lone:
        raise SystemExit("the batched decoder's outputs or counts differ from the one-at-a-time decoder's")
    ngram_lone, ngram_lone_s = timed(lambda: [ngram_decode(target, p, **ngram_kw) for p in prompts])
    (ngram_batched, ngram_again), ngram_batched_s = timed(
        lambda: ngram_decode_batch(target, prompts, batch_size=args.batch, **ngram_kw))
    if ngram_batched != ngram_lone:
        raise SystemExit("the batched n-gram decoder's outputs or counts differ from the one-at-a-time decoder's")
    greedy_tokens, greedy_s = timed(lambda: _greedy(target, tok, prompts, args.batch, args.max_new_tokens, stops))

    figures = tau_figures(lone, cfg.block_size - 1)
    tokens = figures["new_tokens"] + len(prompts)  # the first token of each prompt comes from the prefill
    ngram_tokens = tau_figures(ngram_lone, cfg.block_size - 1)["new_tokens"] + len(prompts)
    rate, base, limit = tokens / batched_s, tokens / lone_s, greedy_tokens / greedy_s
    print(f"prompts {len(prompts)} x {args.max_new_tokens} new tokens, batch {args.batch}, threads {args.threads}; "
          f"DFlash tau {figures['tau']:.3f}; decoded again alone: {again} (DFlash), {ngram_again} (n-gram)")
    print(f"DFlash: batched {rate:.1f} tokens/s, one at a time {base:.1f}; n-gram: batched "
          f"{ngram_tokens / ngram_batched_s:.1f}, one at a time {ngram_tokens / ngram_lone_s:.1f}; "
          f"greedy (batched generate) {limit:.1f}")
    _common.report("evaluate", "tokens/s", rate, baseline=base, limit=limit, equal=True, recomputed=again,
                   tau=round(figures["tau"], 3), ngram_batched=round(ngram_tokens / ngram_batched_s, 3),
                   ngram_one_at_a_time=round(ngram_tokens / ngram_lone_s, 3),
                   ngram_vs_baseline=round(ngram_lone_s / ngram_batched_s, 3), ngram_recomputed=ngram_again,
                   prompts=len(prompts), max_new_tokens=args.max_new_tokens, batch=args.batch, threads=args.threads)


if __name__ == "__main__":
    main()
