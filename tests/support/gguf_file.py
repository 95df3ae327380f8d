"""A tiny Llama checkpoint written as a GGUF file the way llama.cpp's converter writes one.

A byte-level BPE tokenizer is trained here on a few sentences (with ChatML specials and a chat template),
and the weights of a random ``LlamaForCausalLM`` are written as float32 tensors under llama.cpp's names,
with the query and key rows permuted as llama.cpp stores them. transformers' own GGUF reader then gives
back exactly the model written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = ["The quick brown fox jumps over the lazy dog.", "Speculative decoding drafts tokens that the target verifies.",
        "def add(a, b):\n    return a + b\n", "Hello! How can I help you today?"] * 4


def _bpe_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXT, trainer)
    return tok


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order for q/k projections (transformers undoes it when it reads the file)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_llama_gguf(path: Path, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                          seed: int = 0, tied: bool = True, claimed_shape: tuple[int, int] | None = None):
    """Write a tiny Llama as GGUF at ``path``; returns the ``LlamaForCausalLM`` it holds (float32, eval).
    ``claimed_shape``: (hidden size, layers) its metadata states instead of the real ones (a lying file)."""
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _bpe_tokenizer(320)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) for m in tok.model.get_merges()] if hasattr(tok.model, "get_merges") else []
    if not merges:
        import json

        merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=tied, bos_token_id=vocab["<|im_start|>"],
                         eos_token_id=vocab["<|im_end|>"])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    for p in model.parameters():  # non-trivial norms so a wrong mapping shows
        if p.dim() == 1:
            p.data.uniform_(0.5, 1.5)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(512)
    stated_hidden, stated_layers = claimed_shape or (hidden, layers)
    writer.add_embedding_length(stated_hidden)
    writer.add_block_count(stated_layers)
    writer.add_feed_forward_length(2 * stated_hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|im_end|>"])
    writer.add_chat_template(CHATML)

    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(layers):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], kv_heads))
        writer.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not tied:
        writer.add_tensor("output.weight", sd["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
