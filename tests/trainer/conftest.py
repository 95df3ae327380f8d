"""Fixtures of the trainer tests: a dataset of the tiny target's own generations."""

from __future__ import annotations

import pytest

from tests.trainer.data_support import self_generated_samples, write_dataset


@pytest.fixture(scope="session")
def tiny_samples(tiny_qwen3_dir):
    return self_generated_samples(tiny_qwen3_dir, num=32, new_tokens=40)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory, tiny_qwen3_dir, tiny_samples):
    """A file:// token dataset of 32 self-generated chats (prompt masked out, reply trained)."""
    root = tmp_path_factory.mktemp("tokens")
    return write_dataset(f"file://{root}", *tiny_samples, tiny_qwen3_dir)
