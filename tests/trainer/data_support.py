"""Token datasets for trainer tests: the tiny target's own generations, tokenized with its chat template."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from dfp_shared.models.tokenizer_assets import (
    chat_template_fingerprint,
    load_tokenizer,
    tokenizer_fingerprint,
)
from dfp_shared.records.token_shards import build_manifest, encode_shard, shard_entry
from dfp_shared.storage.store import open_store

TOPICS = ["rivers", "prime numbers", "bread", "comets", "chess", "volcanoes", "owls", "bridges", "tea", "glaciers",
          "robots", "maps", "violins", "deserts", "coral", "clocks"]


def self_generated_samples(model_dir: Path, num: int = 32, new_tokens: int = 48, seed: int = 0) -> tuple[list, list]:
    """(token lists, loss masks): chat prompts (mask 0) followed by the target's own sampled reply (mask 1).

    All prompts are sampled together, one decoder pass per new token over the left-padded batch, with
    the LM head applied to the last position only (cheap even with Qwen3's 151k vocabulary).
    """
    from dfp_shared.models.loading import load_causal_lm

    tok = load_tokenizer(model_dir)
    model = load_causal_lm(str(model_dir), device="cpu")
    prompts = []
    for i in range(num):
        msgs = [{"role": "user", "content": f"Tell me fact {i} about {TOPICS[i % len(TOPICS)]}."}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    width = max(map(len, prompts))
    ids = torch.zeros(num, width + new_tokens, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):width] = torch.tensor(p)
        attn[row, width - len(p):width] = 1
    gen = torch.Generator().manual_seed(seed)
    base, head = model.get_decoder(), model.get_output_embeddings()
    with torch.inference_mode():
        for t in range(width, width + new_tokens):
            pos = (attn[:, :t].cumsum(1) - 1).clamp(min=0)
            hidden = base(input_ids=ids[:, :t], attention_mask=attn[:, :t], position_ids=pos).last_hidden_state
            logits = head(hidden[:, -1]) / 0.7  # (num, V)
            top = torch.topk(logits, 20, dim=-1)
            pick = torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen)
            ids[:, t] = top.indices.gather(1, pick).squeeze(1)
            attn[:, t] = 1
    tokens = [p + ids[row, width:].tolist() for row, p in enumerate(prompts)]
    masks = [[0] * len(p) + [1] * new_tokens for p in prompts]
    return tokens, masks


@functools.lru_cache(maxsize=8)
def _fingerprints(tokenizer_dir: str) -> tuple[str, str]:
    tok = load_tokenizer(tokenizer_dir)
    return tokenizer_fingerprint(tok), chat_template_fingerprint(tok)


def write_dataset(uri: str, tokens: list, masks: list, tokenizer_dir: Path, *, shards: int = 2,
                  endpoint_url: str | None = None, fingerprint: str | None = None) -> str:
    """Write a token dataset (shards + manifest) as the tokenizer service lays it out."""
    tok_fp, tpl_fp = _fingerprints(str(tokenizer_dir))
    meta = {"tokenizer_fingerprint": fingerprint or tok_fp, "chat_template_fingerprint": tpl_fp}
    store = open_store(uri, endpoint_url=endpoint_url)
    entries = []
    per = max(1, -(-len(tokens) // shards))
    for s in range(0, len(tokens), per):
        ids = [f"s{i}" for i in range(s, min(len(tokens), s + per))]
        data = encode_shard(ids, tokens[s:s + per], masks[s:s + per], {**meta, "source": f"in-{s}.jsonl"})
        key = f"shards/in-{s:05d}.safetensors"
        store.put(key, data)
        entries.append(shard_entry(key, data))
    store.put("manifest.json", json.dumps(build_manifest(entries)).encode())
    return uri
