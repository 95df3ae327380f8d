"""Models: loading targets and tokenizers (safetensors only, no remote code), GGUF import (the header read claim by
claim, the conversion confined to a child process), stop tokens."""

from dfp_shared import public_face

__getattr__, __all__ = public_face(__name__, {
    "loading": ["load_causal_lm", "local_model_dir", "check_loadable", "model_fingerprint"],
    "tokenizer_assets": ["load_tokenizer", "choose_mask_token"],
    "gguf_import": ["import_gguf", "convert_gguf", "GGUFError"],
    "gguf_header": ["scan", "HeaderError"],
    "confined": ["run_confined", "Limits"],
    "stop_tokens": ["stop_token_ids"],
})
