"""Generation at the machine's rate: generated tokens/s of the openai engine against the real vLLM (CPU build).

The real vLLM (:mod:`dfp_dev.serving`, its own environment, installed on first use) serves
SmolLM2-135M-Instruct (:mod:`dfp_dev.targets.smollm2`); the engine answers ``--prompts`` chat prompts greedily
(thinking off, no streaming), all in one call as one shard of a generate job:

* project - the engine at its default concurrency (sized from the server's published KV capacity);
* baseline - the engine as the generate job drove it before: concurrency 64, prompts in shards of 64;
* limit - the target's forward alone, in process (transformers, float32, batches of 16 sequences, the same
  prompts and answers): tokens/s of the work every generated token needs at least once.

Runs in about three minutes on 2 quiet cores once vLLM is installed (six under load). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import _common  # noqa: F401  (import path)

TOPICS = ["rivers", "prime numbers", "bread", "comets", "chess", "volcanoes", "owls", "bridges", "tea", "glaciers",
          "robots", "maps", "violins", "deserts", "coral", "clocks"]
ASKS = ["Explain how {} work.", "Write a short story about {}.", "List five facts about {}.", "Describe {} to a child.",
        "What is the history of {}?", "Compare {} with something similar."]


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": ASKS[i % len(ASKS)].format(TOPICS[i // len(ASKS) % len(TOPICS)])}]
            for i in range(n)]


def run_engine(base_url: str, model: str, messages: list[list[dict]], max_new_tokens: int,
               concurrency: int | None, shard: int) -> tuple[list, float, int]:
    """Answers (in prompt order), seconds and the concurrency used, ``shard`` prompts per engine call."""
    import asyncio

    from dfp_generation.engines import GenRequest, SamplingParams
    from dfp_generation.engines.openai_engine import OpenAIEngine

    engine = OpenAIEngine(base_url, model, concurrency=concurrency, timeout_s=1800, max_retries=0)
    params = SamplingParams(0.0, 1.0, max_new_tokens, thinking=False)
    try:
        engine.generate([GenRequest("warm", messages[0], 0)], params)
        used = asyncio.run_coroutine_threadsafe(engine.slots(max_new_tokens), engine._ensure_loop()).result()
        reqs = [GenRequest(str(i), m, i) for i, m in enumerate(messages)]
        began = time.perf_counter()
        results = [r for b in range(0, len(reqs), shard) for r in engine.generate(reqs[b : b + shard], params)]
        seconds = time.perf_counter() - began
    finally:
        engine.close()
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise SystemExit(f"{len(bad)} requests failed, e.g. {bad[0]}")
    return sorted(results, key=lambda r: int(r.id)), seconds, used


def forward_rate(model_dir, messages: list[list[dict]], answers: list[str], batch: int = 16) -> tuple[float, int]:
    """Tokens/s of the target's forward alone over the prompts with their answers, and the tokens it read."""
    import torch
    from dfp_shared.models.loading import load_causal_lm
    from dfp_shared.models.tokenizer_assets import load_tokenizer

    tok = load_tokenizer(model_dir)
    model = load_causal_lm(str(model_dir), device="cpu")
    texts = [tok.apply_chat_template(m + [{"role": "assistant", "content": a}], tokenize=False)
             for m, a in zip(messages, answers)]
    seqs = sorted((tok(t, add_special_tokens=False)["input_ids"] for t in texts), key=len)
    tokens, began = 0, time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(seqs), batch):
            group = seqs[b : b + batch]
            width = max(len(s) for s in group)
            ids = torch.zeros(len(group), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, s in enumerate(group):
                ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
            model(input_ids=ids, attention_mask=mask, logits_to_keep=1)
            tokens += sum(len(s) for s in group)
    return tokens / (time.perf_counter() - began), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=128, help="Chat prompts answered.")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="Most tokens per answer.")
    ap.add_argument("--kv-cache-gib", type=int, default=2, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE).")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="Torch threads of the forward.")
    args = ap.parse_args()

    import torch
    from dfp_dev.serving.vllm_env import ensure_env
    from dfp_dev.serving.vllm_server import VllmServer
    from dfp_dev.targets.smollm2 import smollm2_dir

    model = smollm2_dir()
    messages = prompts(args.prompts)
    with tempfile.TemporaryDirectory(prefix="bench-generation-real-") as logs:
        server = VllmServer(ensure_env(), model, logs, kv_cache_gib=args.kv_cache_gib, max_model_len=1024)
        server.start()
        try:
            base = server.base_url + "/v1"
            results, seconds, used = run_engine(base, str(model), messages, args.max_new_tokens, None, len(messages))
            old, old_seconds, _ = run_engine(base, str(model), messages, args.max_new_tokens, 64, 64)
        finally:
            server.stop()
    generated = sum(r.completion_tokens for r in results)
    print(f"generated {generated} tokens in {seconds:.1f} s at concurrency {used}; concurrency 64 in shards of 64: "
          f"{sum(r.completion_tokens for r in old)} in {old_seconds:.1f} s", flush=True)
    torch.set_num_threads(args.threads)
    limit, read = forward_rate(model, messages, [r.content for r in results])
    rate, baseline = generated / seconds, sum(r.completion_tokens for r in old) / old_seconds
    print(f"{args.prompts} prompts, {generated} tokens generated in {seconds:.1f} s at concurrency {used} "
          f"(server KV cache {args.kv_cache_gib} GiB); concurrency 64 in shards of 64: {baseline:.1f} tokens/s; "
          f"the target's forward alone: {limit:.1f} tokens/s over {read} tokens")
    _common.report("generation_real", "tokens/s", rate, baseline=baseline, limit=limit, concurrency=used,
                   prompts=args.prompts, max_new_tokens=args.max_new_tokens, generated_tokens=generated,
                   kv_cache_gib=args.kv_cache_gib, threads=args.threads)


if __name__ == "__main__":
    main()
