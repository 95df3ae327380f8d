"""Target fixtures: tiny models loaded once, in-process servers around them, private shm dirs."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def qwen3_model(tiny_qwen3_dir):
    from dfp_shared.models.loading import load_causal_lm

    return load_causal_lm(str(tiny_qwen3_dir))


@pytest.fixture(scope="session")
def hybrid_model(tiny_hybrid_dir):
    from dfp_shared.models.loading import load_causal_lm

    return load_causal_lm(str(tiny_hybrid_dir))


@pytest.fixture
def shm_dir():
    """A private directory on the memory-backed /dev/shm (falls back to a temp dir)."""
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    path = Path(tempfile.mkdtemp(prefix="dfp-test-shm-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_server(tmp_path):
    """Build and start in-process target servers: ``make_server(model, model_dir, run=None, **settings)``."""
    from dfp_shared.hidden_states import build_model_info, forward_batch
    from dfp_target.server import TargetServer
    from dfp_target.settings import TargetSettings

    servers = []

    def make(model, model_dir, run=None, layer_ids=None, **overrides):
        overrides.setdefault("shm_dir", "")
        settings = TargetSettings(model=str(model_dir), host="127.0.0.1", port=0, **overrides)
        info = build_model_info(model, model_dir, layer_ids=layer_ids,
                                max_tokens_per_request=settings.max_tokens_per_request,
                                max_message_bytes=settings.max_message_bytes)
        server = TargetServer(settings, info, run=run or (lambda seqs, layers: forward_batch(model, seqs, layers))).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop(grace=1, linger=0)
