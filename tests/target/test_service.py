"""The target as its container runs it (``dflash-pipeline target serve`` in a subprocess): health,
reflection, metrics, a kill and restart mid-stream (gRPC and shared-memory callers both get complete,
correct results, and the shared-memory client keeps what it owns in order), a killed shared-memory
client whose segments the server frees, and a graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import threading
import urllib.request

import grpc
from dfp_shared.hidden_states import SERVICE, TargetClient, forward_batch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.support.cli import cli_env
from tests.support.servers import free_port

from .support import ServerProcess, close_enough, random_sequences, shm_files, wait_until

BIG = dict(lengths=[128] * 32, seed=3)


def test_kill_and_restart_mid_stream(tiny_qwen3_dir, qwen3_model, shm_dir):
    """Both callers get complete, correct results across a SIGKILL and restart of the server. Shared
    memory: the client owns every segment (the server only maps them), so with the server dead the
    client's pool holds no lease of a failed call, stays bounded, and is the only owner of anything in
    the shared-memory directory (the restarted server's start-up sweep leaves a live client's segments
    alone); closing the client removes all of it."""
    server = ServerProcess(tiny_qwen3_dir, "--chunk-bytes", "4096", "--max-batch-tokens", "128",
                           "--shm-dir", str(shm_dir)).start()
    sequences = random_sequences([128] * 24, seed=3)  # 24 forward passes, 24 chunks per sequence
    layers = [1, 4, 6]
    tokens_per_call = 1024
    calls = -(-sum(len(s) for s in sequences) // tokens_per_call)  # calls in flight at once per client
    try:
        grpc_client = TargetClient(server.address, tokens_per_call=tokens_per_call, backoff_max_s=0.5,
                                   retry_deadline_s=120)
        shm_client = TargetClient(server.address, tokens_per_call=tokens_per_call, backoff_max_s=0.5,
                                  retry_deadline_s=120, shm_dir=str(shm_dir))

        grpc_client.model_info(), shm_client.model_info()

        async def go():
            tasks = [asyncio.ensure_future(c.hidden_states(sequences, layers)) for c in (grpc_client, shm_client)]
            while grpc_client.stats["chunks"] == 0 and shm_client.stats["chunks"] == 0:
                await asyncio.sleep(0.001)
            server.kill()  # mid-stream: one caller has part of its answer, the other's calls are queued
            killed_at = (grpc_client.stats["chunks"], shm_client.stats["chunks"])
            await asyncio.to_thread(server.start)
            results = await asyncio.gather(*tasks)
            via_grpc, via_shm = results[0], [t.clone() for t in results[1]]
            pool = shm_client._pool
            state = {"views": sum(pool.in_use().values()), "files": shm_files(shm_dir),
                     "owned": sorted([*pool.names(), pool.lock_name])}
            del tasks, results  # drop every view of the segments; the loop's handle of this step
            await asyncio.sleep(0)  # still refers to the gathered results until the next one
            gc.collect()
            state.update(in_use=pool.in_use(), segments=len(pool.names()))
            await grpc_client.close()
            await shm_client.close()
            return via_grpc, via_shm, killed_at, state

        via_grpc, via_shm, killed_at, state = asyncio.run(go())
    finally:
        server.stop()
    assert grpc_client.stats["retries"] >= 1 and shm_client.stats["retries"] >= 1
    assert sum(killed_at) < 2 * 24 * 24  # not every chunk was there yet
    expected = forward_batch(qwen3_model, sequences[:2], layers)
    for i, seq in enumerate(sequences):
        alone = forward_batch(qwen3_model, [seq], layers)[0] if i >= 2 else expected[i]
        assert close_enough(via_grpc[i], alone) and close_enough(via_shm[i], alone)
    assert state["views"] == len(sequences)  # one use per tensor viewing a segment: no call's lease left
    assert state["in_use"] == {}  # views dropped: every segment free for reuse
    assert 1 <= state["segments"] <= 2 * calls  # per call: the failed attempt's segment and the retry's
    assert state["files"] == state["owned"]  # nothing of the dead server's, nothing of the client's lost
    assert shm_files(shm_dir) == []  # the client closed: unlinked


def server_mappings(pid: int, directory) -> list[str]:
    """Memory mappings of process ``pid`` backed by files in ``directory`` (deleted ones included)."""
    prefix = str(directory).rstrip("/") + "/"
    with open(f"/proc/{pid}/maps") as maps:
        return [line.split(None, 5)[-1].strip() for line in maps if prefix in line]


def test_client_killed_mid_transfer_server_frees_its_segments(tiny_qwen3_dir, shm_dir):
    """The server maps a client's segments and keeps the mappings across calls; when a client process
    dies mid-call the server removes its segments and lock file and unmaps them (a mapped segment
    would keep its memory after the file is gone), and keeps serving. (The sweep the end of a call
    triggers is checked in test_shm; here either it or the periodic one may come first.)"""
    server = ServerProcess(tiny_qwen3_dir, "--max-batch-tokens", "128", "--shm-dir", str(shm_dir),
                           env={"DFLASH_SHM_SWEEP_SECONDS": "1"}).start()
    try:
        live = TargetClient(server.address, shm_dir=str(shm_dir))

        async def one_call():
            try:
                out = await live.hidden_states(random_sequences([12]), [1])
                return out[0].shape, live._pool.names(), server_mappings(server.proc.pid, shm_dir)
            finally:
                await live.close()

        shape, live_segments, mapped = asyncio.run(one_call())
        assert shape == (12, 64) and live_segments
        assert any(name in m for name in live_segments for m in mapped), mapped  # the check sees the server's maps

        proc = subprocess.run([sys.executable, "-m", "tests.target.shm_client_proc", str(server.port), str(shm_dir),
                               "48", "120"], env=cli_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == -9, proc.stderr
        owner = proc.stdout.split("owner", 1)[1].split()[0]
        segments = proc.stdout.split("segments", 1)[1].split()
        assert segments and all(owner in name for name in segments)
        assert wait_until(lambda: shm_files(shm_dir) == [], 30), shm_files(shm_dir)
        assert wait_until(lambda: server_mappings(server.proc.pid, shm_dir) == [], 30), \
            server_mappings(server.proc.pid, shm_dir)
        assert server.proc.poll() is None, server.ended()  # the dead client's call did not take the server down
        after = TargetClient(server.address)

        async def still_serving():
            try:
                return await after.hidden_states(random_sequences([5]), [1])
            finally:
                await after.close()

        assert asyncio.run(still_serving())[0].shape == (5, 64)
        assert server.proc.poll() is None, server.ended()
    finally:
        server.stop()


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
