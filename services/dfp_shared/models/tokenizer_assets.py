"""Tokenizer loading, the DFlash mask token, and the fingerprints of a tokenizer and its chat template."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MASK_TOKEN = "<|MASK|>"
AUTO_MASK_TOKEN = "auto"  # a train spec's mask_token: MASK_TOKEN if the tokenizer has it, else a spare special token


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


def choose_mask_token(tokenizer, requested: str = AUTO_MASK_TOKEN) -> str:
    """The token DFlash fills block positions with: ``requested`` itself, or for ``auto`` :data:`MASK_TOKEN` when
    the tokenizer has it, else its own ``mask_token``, else its special token of the highest id that is none of
    bos/eos/pad/unk and that the chat template never writes (e.g. SmolLM2's ``<empty_output>``).

    The drafter's mask embedding is then the target's frozen embedding of that token, which every engine
    reads from ``mask_token_id``. Raises ValueError naming what is missing.
    """
    vocab = tokenizer.get_vocab()
    if requested != AUTO_MASK_TOKEN:
        if requested not in vocab:
            raise ValueError(f"the target's tokenizer has no mask token {requested!r}: name one of its tokens, "
                             f"or {AUTO_MASK_TOKEN!r}")
        return requested
    if MASK_TOKEN in vocab:
        return MASK_TOKEN
    own = getattr(tokenizer, "mask_token", None)
    if own and own in vocab:
        return own
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    taken = {getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    spare = [(index, added.content) for index, added in tokenizer.added_tokens_decoder.items()
             if added.special and added.content not in taken and added.content not in template]
    if not spare:
        raise ValueError(f"the target's tokenizer has no {MASK_TOKEN!r} and no spare special token for DFlash's mask "
                         "positions: add one (tokenizer.add_special_tokens) or name a rarely used token as mask_token")
    return max(spare)[1]

