"""API fixtures: API keys, an app on the session's Redis, an HTTP client with a given key."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading

import pytest
from fastapi.testclient import TestClient

WRITE_KEY = "dfp_test-write-key-0123456789"
READ_KEY = "dfp_test-read-key-0123456789"


def key_entries() -> str:
    return json.dumps([
        {"name": "writer", "sha256": hashlib.sha256(WRITE_KEY.encode()).hexdigest(), "scopes": ["read", "write"]},
        {"name": "reader", "sha256": hashlib.sha256(READ_KEY.encode()).hexdigest(), "scopes": ["read"]},
    ])


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


# the storage the API tests' specs name (nothing is read there: no worker runs), plus the session's own
API_TEST_STORAGE = "s3://bucket,file:///data,file:///models"


@pytest.fixture
def make_app(redis_server):
    from dfp_api.app import create_app
    from dfp_api.settings import ApiSettings

    def make(**overrides):
        settings = ApiSettings(**{"redis_url": redis_server.url, "api_keys": key_entries(), "sse_poll_s": 0.2,
                                  "rate_limit_per_s": 1000.0, "rate_limit_burst": 1000,
                                  "allowed_prefixes": f"{API_TEST_STORAGE},{os.environ.get('DFLASH_ALLOWED_PREFIXES', '')}",
                                  **overrides})
        return create_app(settings)

    return make


@contextlib.contextmanager
def served(app, http=None, **config):
    """``app`` under a real uvicorn (httptools with the head limits, as served) on a free loopback port, with
    further uvicorn ``config`` (e.g. ``limit_concurrency``); yields the port."""
    import uvicorn
    from dfp_api.server import uvicorn_config
    from dfp_api.settings import ApiSettings

    from tests.support.servers import free_port, wait_for_port

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on",
                                        http=http or uvicorn_config(ApiSettings(auth_disabled=True))["http"],
                                        log_config=None, access_log=False, **config))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    wait_for_port(port, timeout=30)
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(10)


@pytest.fixture
def api(make_app, redis_client):
    """A TestClient (lifespan started) authenticated with the write key."""
    with TestClient(make_app(), headers=auth(WRITE_KEY)) as client:
        yield client


@pytest.fixture(scope="session")
def encoders(tmp_path_factory):
    """The tokenizer service's encoder cache, shared so the real Qwen3 tokenizer loads once."""
    from dfp_tokenizer.tasks import EncoderCache

    return EncoderCache(cache_dir=str(tmp_path_factory.mktemp("tokenizer-cache")))
