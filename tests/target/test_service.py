"""The target as its container runs it (``dflash-pipeline target serve`` in a subprocess): health,
reflection, metrics, a kill and restart mid-stream (gRPC and shared-memory callers both get complete,
correct results), and a graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import threading
import urllib.request

import grpc
from dfp_shared.hidden_states import forward_batch
from dfp_shared.target_client import TargetClient
from dfp_shared.target_wire import SERVICE
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.support.servers import free_port

from .support import ServerProcess, close_enough, random_sequences, shm_files, wait_until

BIG = dict(lengths=[128] * 32, seed=3)


def test_kill_and_restart_mid_stream(tiny_qwen3_dir, qwen3_model, shm_dir):
    server = ServerProcess(tiny_qwen3_dir, "--chunk-bytes", "4096", "--max-batch-tokens", "128",
                           "--shm-dir", str(shm_dir)).start()
    sequences = random_sequences([128] * 24, seed=3)  # 24 forward passes, 24 chunks per sequence
    layers = [1, 4, 6]
    try:
        grpc_client = TargetClient(server.address, tokens_per_call=1024, backoff_max_s=0.5, retry_deadline_s=120)
        shm_client = TargetClient(server.address, tokens_per_call=1024, backoff_max_s=0.5, retry_deadline_s=120,
                                  shm_dir=str(shm_dir))

        grpc_client.model_info(), shm_client.model_info()

        async def go():
            tasks = [asyncio.ensure_future(c.hidden_states(sequences, layers)) for c in (grpc_client, shm_client)]
            while grpc_client.stats["chunks"] == 0 and shm_client.stats["chunks"] == 0:
                await asyncio.sleep(0.001)
            server.kill()  # mid-stream: one caller has part of its answer, the other's calls are queued
            killed_at = (grpc_client.stats["chunks"], shm_client.stats["chunks"])
            await asyncio.to_thread(server.start)
            results = await asyncio.gather(*tasks)
            await grpc_client.close()
            await shm_client.close()
            return results, killed_at

        (via_grpc, via_shm), killed_at = asyncio.run(go())
    finally:
        server.stop()
    assert grpc_client.stats["retries"] >= 1 and shm_client.stats["retries"] >= 1
    assert sum(killed_at) < 2 * 24 * 24  # not every chunk was there yet
    expected = forward_batch(qwen3_model, sequences[:2], layers)
    for i, seq in enumerate(sequences):
        alone = forward_batch(qwen3_model, [seq], layers)[0] if i >= 2 else expected[i]
        assert close_enough(via_grpc[i], alone) and close_enough(via_shm[i], alone)
    assert shm_files(shm_dir) == []


def test_health_reflection_metrics_and_drain_on_sigterm(tiny_qwen3_dir):
    metrics_port = free_port()
    server = ServerProcess(tiny_qwen3_dir, "--chunk-bytes", "4096", "--max-batch-tokens", "128",
                           "--metrics-port", str(metrics_port), "--layer-ids", "1,3,5").start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", SERVICE):
                status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
                assert status == health_pb2.HealthCheckResponse.SERVING
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = {s.name for s in next(replies).list_services_response.service}
            assert {SERVICE, "grpc.health.v1.Health"} <= names

        client = TargetClient(server.address, tokens_per_call=1 << 16)
        info = client.model_info()
        assert info.layer_ids == [1, 3, 5] and info.hidden_size == 64 and info.dtype == "float32"
        asyncio.run(client.hidden_states(random_sequences([10, 20]), [3]))
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert "dflash_target_tokens_total 30.0" in body
        assert "dflash_target_batch_sequences_count" in body and "dflash_target_queue_wait_seconds_count" in body
        sequences = random_sequences(**BIG)
        result: dict = {}

        def call():
            result["out"] = asyncio.run(client.hidden_states(sequences, [3, 5]))

        before = client.stats["chunks"]
        caller = threading.Thread(target=call)
        caller.start()
        assert wait_until(lambda: client.stats["chunks"] > before, 60)
        code = server.terminate(timeout=60)  # drains: the call in flight completes
        caller.join(30)
        assert code == 0
        assert len(result["out"]) == len(sequences) and all(o.shape == (128, 128) for o in result["out"])
        assert client.stats["retries"] == 0
    finally:
        server.stop()
