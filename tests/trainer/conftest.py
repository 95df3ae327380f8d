"""Fixtures of the trainer tests: a dataset of the tiny target's own generations."""

from __future__ import annotations

import pytest

from tests.trainer.data_support import self_generated_samples, write_dataset
from tests.trainer.train_support import torch_threads


@pytest.fixture(scope="session")
def tiny_samples(tiny_qwen3_dir):
    with torch_threads(1):
        return self_generated_samples(tiny_qwen3_dir, num=24, new_tokens=32)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory, tiny_qwen3_dir, tiny_samples):
    """A file:// token dataset of 24 self-generated chats (prompt masked out, reply trained)."""
    root = tmp_path_factory.mktemp("tokens")
    return write_dataset(f"file://{root}", *tiny_samples, tiny_qwen3_dir)


@pytest.fixture
def one_thread():
    """Torch on one thread for the test (the workers' tests run beside others)."""
    with torch_threads(1):
        yield


@pytest.fixture
def target_server(tiny_qwen3_dir):
    """The real gRPC target service on a loopback port, on the tiny target."""
    from dfp_target.service import build
    from dfp_target.settings import TargetSettings

    server = build(TargetSettings(model=str(tiny_qwen3_dir), host="127.0.0.1", port=0, shm_dir="",
                                  device="cpu")).start()
    yield server
    server.stop(grace=1)
