"""The trainer sends a job's tokens only to targets the operator configured; a spec names one.

A plain TCP listener stands in for an address a caller would like the tokens sent to: it records
every connection. The worker loop, Redis and the gRPC target service are the real ones.
"""

from __future__ import annotations

import json
import socket
import threading

import pytest
from dfp_shared.config import ConfigError, load_settings
from dfp_shared.jobs.queue import TaskQueue
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import PLAN_KEY, queue_job
from dfp_shared.jobs.worker import Worker
from dfp_shared.specs.train import TrainSpec
from dfp_trainer.settings import TrainerSettings
from dfp_trainer.worker import TrainHandler, child_env

from tests.trainer.train_support import tiny_spec, torch_threads


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


class Listener:
    """A TCP port that accepts and drops connections, counting them."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def listener():
    lst = Listener()
    yield lst
    lst.close()


def run_one(redis_client, settings) -> None:
    worker = Worker(TaskQueue(redis_client, "train", lease_ms=settings.lease_ms), JobStore(redis_client),
                    TrainHandler(settings, redis_client), heartbeat_s=0.5)
    worker.run(max_tasks=1, idle_exit_s=5)


def test_a_free_target_address_in_a_spec_is_refused_and_never_dialled(tmp_path, redis_server, redis_client,
                                                                      tiny_qwen3_dir, tiny_dataset, listener):
    spec = tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/out", target_url=listener.address)
    with pytest.raises(ValueError, match="target_url.*target_endpoint"):
        queue_job(redis_client, "train", spec)

    # the same spec written straight into Redis, past the API
    job, _ = JobStore(redis_client).create("train", spec, primary_unit="steps")
    TaskQueue(redis_client, "train").enqueue(job.id, PLAN_KEY, {"plan": True})
    run_one(redis_client, TrainerSettings(redis_url=redis_server.url, device="cpu"))
    rec = JobStore(redis_client).get(job.id)
    assert rec.state == JobState.failed and "target_endpoint" in rec.error, rec.error
    assert listener.connections == 0


@pytest.mark.parametrize("name", ["127.0.0.1:50051", "dns:///target.svc:50051", "http://x", "a,b", ""])
def test_a_target_endpoint_is_a_name_not_an_address(name):
    with pytest.raises(ValueError, match="target_endpoint"):
        TrainSpec(dataset="/d", target="/t", output="/o", target_endpoint=name)


def test_an_unconfigured_name_fails_the_job_at_once(tmp_path, redis_server, redis_client, tiny_qwen3_dir,
                                                    tiny_dataset, listener):
    """``inprocess`` is a choice only where the operator made it one."""
    settings = TrainerSettings(redis_url=redis_server.url, device="cpu", target_url=listener.address,
                               target_endpoints=json.dumps({"big": "127.0.0.1:1"}))
    for name in ("elsewhere", "inprocess"):
        job, _ = queue_job(redis_client, "train", tiny_spec(tiny_dataset, tiny_qwen3_dir, f"file://{tmp_path}/{name}",
                                                            target_endpoint=name))
        run_one(redis_client, settings)
        rec = JobStore(redis_client).get(job.id)
        assert rec.state == JobState.failed, rec.error
        assert f"target_endpoint {name!r} is not configured" in rec.error and "'default', 'big'" in rec.error
        assert TaskQueue(redis_client, "train").dead_letters() == []  # not retried
    assert listener.connections == 0


def test_names_resolve_to_configured_addresses():
    settings = TrainerSettings(target_url="10.0.0.1:50051",
                               target_endpoints=json.dumps({"local": "inprocess", "pool": "a:1,b:2"}))
    assert settings.target_address(None) == settings.target_address("default") == "10.0.0.1:50051"
    assert settings.target_address("local") == "inprocess" and settings.target_address("pool") == "a:1,b:2"
    assert TrainerSettings().target_address(None) == "inprocess"  # the embedded default


def test_the_map_reaches_torchrun_children_unchanged(monkeypatch):
    settings = TrainerSettings(target_endpoints=json.dumps({"pool": "a:1,b:2"}), nproc_per_node=2)
    for name, value in child_env(settings).items():
        if name.startswith("DFLASH_"):
            monkeypatch.setenv(name, value)
    assert load_settings(TrainerSettings).target_address("pool") == "a:1,b:2"


@pytest.mark.parametrize("value, reason", [
    ("{nope", "not a JSON object"),
    ('["a:1"]', "not a JSON object"),
    ('{"a b": "x:1"}', "'a b'"),
    ('{"x": ""}', "'x'"),
    ('{"x": 5}', "'x'"),
    ('{"default": "x:1"}', "DFLASH_TARGET_URL"),
])
def test_bad_target_endpoints_refuse_to_start_naming_the_variable(monkeypatch, value, reason):
    monkeypatch.setenv("DFLASH_TARGET_ENDPOINTS", value)
    with pytest.raises(ConfigError) as err:
        load_settings(TrainerSettings)
    assert "DFLASH_TARGET_ENDPOINTS" in str(err.value) and reason in str(err.value), str(err.value)
