"""Client pieces: address resolution, round-robin over replicas, the chunk wire format, the source factory."""

from __future__ import annotations

import socket
import threading

import torch
from dfp_shared.hidden_states import (
    HiddenStateSource,
    InProcessTarget,
    TargetClient,
    forward_batch,
    open_hidden_state_source,
)
from dfp_shared.hidden_states.client import resolve, split_host_port
from dfp_shared.hidden_states.wire import (
    SequenceAssembler,
    decode_chunk,
    pack_tokens,
    tensor_chunks,
    unpack_tokens,
)
from dfp_shared.rpc import target_pb2 as pb

from .support import close_enough, random_sequences, run


def test_split_host_port():
    assert split_host_port("dns:///dflash-target-headless:50051") == ("dflash-target-headless", 50051)
    assert split_host_port("[::1]:7000") == ("::1", 7000)
    assert split_host_port("10.0.0.5") == ("10.0.0.5", 50051)


def test_resolve_gives_every_a_record(monkeypatch):
    real = socket.getaddrinfo

    def fake(host, port, *args, **kwargs):  # a headless Service name with three pods behind it
        if host == "dflash-target-headless":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("10.0.0.7", "10.0.0.5", "10.0.0.6")]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    assert resolve("dns:///dflash-target-headless:50051,127.0.0.1:9") == [
        "10.0.0.5:50051", "10.0.0.6:50051", "10.0.0.7:50051", "127.0.0.1:9"]
    assert "127.0.0.1:9" in resolve("localhost:9")


def test_round_robin_over_replicas(qwen3_model, tiny_qwen3_dir, make_server):
    seen = {0: 0, 1: 0}
    lock = threading.Lock()

    def counting(k):
        def fn(seqs, layers):
            with lock:
                seen[k] += len(seqs)
            return forward_batch(qwen3_model, seqs, layers)

        return fn

    servers = [make_server(qwen3_model, tiny_qwen3_dir, run=counting(k)) for k in range(2)]
    client = TargetClient(",".join(f"127.0.0.1:{s.port}" for s in servers), tokens_per_call=16, channels_per_replica=1)
    sequences = random_sequences([10] * 8)

    async def go():
        try:
            return await client.hidden_states(sequences, [2])
        finally:
            await client.close()

    out = run(go())
    assert seen == {0: 4, 1: 4}  # eight one-sequence calls, alternating
    assert all(close_enough(o, forward_batch(qwen3_model, [s], [2])[0]) for o, s in zip(out, sequences))


def test_chunks_round_trip_without_copies():
    states = torch.randn(37, 3 * 64).to(torch.bfloat16)
    messages = list(tensor_chunks(4, states, chunk_bytes=1000))
    assert len(messages) == -(-states.numel() * 2 // 1000)
    first, _ = decode_chunk(messages[0])
    assembler = SequenceAssembler(first)
    for raw in messages:
        header, data = decode_chunk(raw)
        assert header.sequence == 4 and isinstance(data, memoryview) and data.obj is raw  # a view, not a copy
        done = assembler.add(header, data)
    assert done and torch.equal(assembler.tensor(), states)
    # the hand-appended data field is ordinary protobuf
    parsed = pb.HiddenStatesChunk.FromString(messages[1])
    assert parsed.offset == 1000 and len(parsed.data) == 1000


def test_tokens_pack_and_unpack():
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([7], dtype=torch.int32), torch.tensor([5, 6], dtype=torch.int64)]
    raw, lengths = pack_tokens(seqs)
    got = unpack_tokens(pb.HiddenStatesRequest(token_ids=raw, token_dtype="int32", lengths=lengths))
    assert [g.tolist() for g in got] == [[1, 2, 3], [7], [5, 6]] and all(g.dtype == torch.int32 for g in got)


def test_open_hidden_state_source(tiny_qwen3_dir):
    local = open_hidden_state_source("inprocess", str(tiny_qwen3_dir))
    remote = open_hidden_state_source("127.0.0.1:1,127.0.0.1:2")
    assert isinstance(local, InProcessTarget) and isinstance(remote, TargetClient)
    assert isinstance(local, HiddenStateSource) and isinstance(remote, HiddenStateSource)
    assert remote.replicas == ["127.0.0.1:1", "127.0.0.1:2"]
    info = local.model_info()
    assert info.num_layers == 8 and info.layer_ids == list(range(8)) and info.dtype == "float32"
    run(local.close())
