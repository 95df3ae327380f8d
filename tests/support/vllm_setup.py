"""What the tests against a real vLLM share besides their fixtures (``tests/e2e/conftest.py``): whether vLLM must be
had, and a target's own answers as a token dataset."""

from __future__ import annotations

import os

import pytest

from tests.trainer.data_support import self_generated_samples, write_dataset
from tests.trainer.train_support import torch_threads

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(reason: str):
    """Skip the test for want of vLLM, or fail it with CI set."""
    if CI:
        pytest.fail(f"vLLM is required with CI set: {reason}")
    pytest.skip(f"vLLM is not available here: {reason} (with CI=true this is a failure)")


def self_generated_dataset(root, target) -> str:
    """A file:// token dataset under ``root`` of 24 chats the target answered itself (32 sampled tokens each)."""
    with torch_threads(1):
        tokens, masks = self_generated_samples(target, num=24, new_tokens=32)
        return write_dataset(f"file://{root}/tokens", tokens, masks, target)
