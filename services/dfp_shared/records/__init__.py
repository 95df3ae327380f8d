"""Records: prompt sets, completion records and their manifest, token shards, ``<think>`` splitting, and the capture
layout (written by the pass-through, read by the adaptation loop)."""

from dfp_shared import public_face

__getattr__, __all__ = public_face(__name__, {
    "prompts": ["Prompt", "read_prompt_set", "iter_prompts"],
    "completions": ["completion_record", "encode_records", "read_manifest", "records_key"],
    "token_shards": ["TokenDataset", "encode_shard", "decode_shard", "load_dataset"],
    "thinking": ["split_thinking"],
    "capture_layout": ["HOUR_FORMAT", "HOUR_RE", "CAPTURED_AT_FORMAT", "SHARDS"],
})
