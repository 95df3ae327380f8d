"""Borrowing the target's embedding and LM head straight from its checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from dfp_shared.models.loading import load_causal_lm
from dfp_shared.models.tokenizer_assets import load_tokenizer
from dfp_trainer.drafter.config import DrafterConfig
from dfp_trainer.drafter.model import DFlashDrafter
from dfp_trainer.drafter.target_parts import load_target_parts, mask_token_id, read_target_config
from safetensors.torch import save_file


def test_parts_equal_the_loaded_target(tiny_qwen3_dir):
    parts = load_target_parts(tiny_qwen3_dir)
    target = load_causal_lm(str(tiny_qwen3_dir), device="cpu")
    assert torch.equal(parts.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(parts.lm_head.weight, target.get_output_embeddings().weight)
    assert not parts.embed_tokens.weight.requires_grad and not parts.lm_head.weight.requires_grad
    assert parts.num_layers == 8
    tok = load_tokenizer(tiny_qwen3_dir)
    cfg = DrafterConfig.for_target(parts.config, num_layers=1, mask_token_id=mask_token_id(tok))
    assert cfg.mask_token_id == tok.convert_tokens_to_ids("<|MASK|>") and cfg.target_layer_ids == [4]
    DFlashDrafter(cfg, parts.embed_tokens, parts.lm_head)


def test_hybrid_target_config(tiny_hybrid_dir):
    parts = load_target_parts(tiny_hybrid_dir)
    cfg = DrafterConfig.for_target(parts.config, num_layers=2, mask_token_id=parts.embed_tokens.num_embeddings - 1)
    assert cfg.target_layer_ids == [1, 5] and cfg.hidden_size == parts.config["hidden_size"]


def test_tied_and_multimodal_checkpoints(tmp_path):
    text = {"num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 10, "num_attention_heads": 2,
            "intermediate_size": 16}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": text, "tie_word_embeddings": True}))
    embed = torch.randn(10, 8)
    save_file({"model.language_model.embed_tokens.weight": embed}, str(tmp_path / "model.safetensors"))
    parts = load_target_parts(tmp_path)
    assert torch.equal(parts.lm_head.weight, embed) and parts.config["hidden_size"] == 8


def test_bad_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        read_target_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 8}))
    with pytest.raises(ValueError, match="field 'vocab_size' missing"):
        read_target_config(tmp_path)
    cfg = {"num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 10, "num_attention_heads": 2,
           "intermediate_size": 16}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_target_parts(tmp_path)
    save_file({"model.embed_tokens.weight": torch.randn(10, 8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no LM head tensor"):
        load_target_parts(tmp_path)


def test_missing_mask_token_is_named(qwen3_tokenizer_dir):
    tok = load_tokenizer(qwen3_tokenizer_dir)  # the plain tokenizer, without the DFlash mask token
    with pytest.raises(ValueError, match="no mask token '<\\|MASK\\|>'"):
        mask_token_id(tok, "<|MASK|>")


def test_auto_mask_token_prefers_the_dflash_token_then_a_spare_special_one(qwen3_tokenizer_dir):
    from dfp_shared.models.tokenizer_assets import choose_mask_token

    assert choose_mask_token(load_tokenizer(qwen3_tokenizer_dir, add_mask_token=True)) == "<|MASK|>"
    plain = load_tokenizer(qwen3_tokenizer_dir)
    chosen = choose_mask_token(plain)
    special = {t.content for t in plain.added_tokens_decoder.values() if t.special}
    assert chosen in special and chosen not in plain.chat_template
    assert chosen not in (plain.eos_token, plain.pad_token, plain.bos_token)
    assert mask_token_id(plain) == plain.convert_tokens_to_ids(chosen)
    plain.chat_template += "".join(sorted(special))  # every special token rendered by the template: none spare
    with pytest.raises(ValueError, match="no spare special token"):
        choose_mask_token(plain)
