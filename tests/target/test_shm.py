"""Same-node path: tensors through shared memory equal the gRPC path's; segments are reused, and none
is left behind when the client is killed mid-transfer (the server notices and sweeps) or closes."""

from __future__ import annotations

import subprocess
import sys
import threading

import torch
from dfp_shared.hidden_states import TargetClient, forward_batch, shm_transport

from tests.support.cli import cli_env

from .support import random_sequences, run, shm_files, wait_until


def test_shm_path_equals_grpc_path_and_reuses_segments(qwen3_model, tiny_qwen3_dir, make_server, shm_dir):
    server = make_server(qwen3_model, tiny_qwen3_dir, shm_dir=str(shm_dir), chunk_bytes=8192)
    batches = [random_sequences([9, 50, 3], seed=s) for s in range(3)]

    async def go():
        via_grpc = TargetClient(f"127.0.0.1:{server.port}")
        via_shm = TargetClient(f"127.0.0.1:{server.port}", shm_dir=str(shm_dir))
        try:
            same = []
            for seqs in batches:  # tensors from shm view the segment; dropping them frees it for reuse
                a_list, b_list = await via_grpc.hidden_states(seqs, [0, 7]), await via_shm.hidden_states(seqs, [0, 7])
                same.append(all(torch.equal(a, b) for a, b in zip(a_list, b_list)))
                kept = b_list[1][3:10]  # a derived view keeps the segment in use
                del a_list, b_list
            held = await via_shm.hidden_states(batches[0], [0, 7])  # so this call needs a second segment
            return same, via_shm._pool.names(), via_shm.stats, kept, held
        finally:
            await via_grpc.close()
            await via_shm.close()

    same, names, stats, kept, held = run(go())
    assert all(same)
    assert len(names) == 2  # one segment reused by the three calls, a second while a view of the first lives
    assert stats["chunks"] == sum(len(b) for b in batches) + len(batches[0])  # one handle per sequence, no data
    expected = forward_batch(qwen3_model, batches[2], [0, 7])[1][3:10]
    assert torch.equal(kept, expected)  # the view was not overwritten by the later call
    assert shm_files(shm_dir) == []  # closed: unlinked


def test_client_killed_mid_transfer_leaves_no_segment(qwen3_model, tiny_qwen3_dir, make_server, shm_dir):
    gate = threading.Event()
    calls = []

    def gated_run(seqs, layers):  # the first forward passes; later ones wait until the client is dead
        calls.append(len(seqs))
        if len(calls) > 1:
            gate.wait(60)
        return forward_batch(qwen3_model, seqs, layers)

    server = make_server(qwen3_model, tiny_qwen3_dir, run=gated_run, shm_dir=str(shm_dir), max_batch_tokens=40,
                         shm_sweep_seconds=3600)
    try:
        proc = subprocess.run([sys.executable, "-m", "tests.target.shm_client_proc", str(server.port), str(shm_dir)],
                              env=cli_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == -9, proc.stderr
        segments = proc.stdout.split("segments", 1)[1].split()
        assert segments and all(name.endswith(".seg") for name in segments)
        # the server sees the call cancelled and sweeps the dead client's segment and lock file
        assert wait_until(lambda: shm_files(shm_dir) == [], 30), shm_files(shm_dir)
    finally:
        gate.set()
    # and it keeps serving
    out = run(TargetClient(f"127.0.0.1:{server.port}", shm_dir=str(shm_dir)).hidden_states(random_sequences([5]), [1]))
    assert out[0].shape == (5, 64)


def test_a_segment_dropped_mid_write_is_unmapped_only_after_the_write(shm_dir):
    """The server's sweep drops a dead client's mapping while a call of that client may still be writing
    into it: closing waits for the copy in flight (unmapping under it crashed the server), and the next
    write is refused with ShmError."""
    with shm_transport.ShmPool(shm_dir) as pool:
        seg = pool.acquire(8 << 20)
        cache = shm_transport.SegmentCache(shm_dir)
        mapped = cache.open(seg.name, seg.size, seg.token)
        states = torch.randn(2 << 20)  # 8 MB a copy: the drop below most likely lands during one
        writes, refused = [], []

        def handler():
            while True:
                try:
                    writes.append(mapped.write(shm_transport.HEADER_BYTES, states))
                except shm_transport.ShmError as exc:
                    refused.append(str(exc))
                    return

        writer = threading.Thread(target=handler, daemon=True)
        writer.start()
        assert wait_until(lambda: writes, 30)
        seg.remove_name()  # as the sweep does once the client is dead
        cache.prune()
        writer.join(30)
        cache.close()
    assert not writer.is_alive() and refused and "is no longer mapped" in refused[0], refused


def test_sweep_removes_only_dead_owners(shm_dir):
    code = ("import sys, os, signal; from dfp_shared.hidden_states.shm_transport import ShmPool; p = ShmPool(sys.argv[1]); "
            "p.acquire(1000); p.acquire(5 << 20); print(p.owner, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code, str(shm_dir)], env=cli_env(), capture_output=True, text=True,
                          timeout=60)
    dead_owner = proc.stdout.strip()
    assert len([n for n in shm_files(shm_dir) if dead_owner in n]) == 3  # two segments and the lock
    with shm_transport.ShmPool(shm_dir) as live:
        live.release(live.acquire(100))
        removed = shm_transport.sweep(shm_dir)
        assert sorted(removed) == sorted(n for n in removed if dead_owner in n) and len(removed) == 3
        assert all(live.owner in n for n in shm_files(shm_dir)) and len(shm_files(shm_dir)) == 2
    assert shm_files(shm_dir) == []


def test_segment_names_are_checked(shm_dir):
    for bad in ("../etc/passwd", "dfp-hs-1-zz.seg", "other"):
        try:
            shm_transport.open_segment(shm_dir, bad, 10)
        except shm_transport.ShmError as exc:
            assert "invalid shared-memory segment name" in str(exc)
        else:
            raise AssertionError(f"{bad} accepted")
