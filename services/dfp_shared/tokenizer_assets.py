"""Tokenizer loading, the DFlash mask token, and the fingerprints of a tokenizer and its chat template."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MASK_TOKEN = "<|MASK|>"


def default_cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_CACHE_DIR") or Path.home() / ".cache" / "dflash-pipeline")


def tokenizer_fingerprint(tokenizer) -> str:
    """A stable hash of the vocabulary and added tokens (two tokenizers that encode alike match)."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    return h.hexdigest()[:16]


def chat_template_fingerprint(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    return hashlib.sha256(template.encode()).hexdigest()[:16]


def load_tokenizer(path: str | os.PathLike, add_mask_token: bool = False):
    """Load a Hugging Face tokenizer directory; optionally add the DFlash mask token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)  # no tokenizer code from storage
    if add_mask_token and MASK_TOKEN not in tok.get_vocab():
        tok.add_special_tokens({"additional_special_tokens": [MASK_TOKEN]})
    return tok
