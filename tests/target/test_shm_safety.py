"""Attacks on the shared-memory fast path by a local process that can send gRPC requests and plant
files: symlinks under segment names, other clients' segments, a shared directory others can write."""

from __future__ import annotations

import os

import grpc
import pytest
import torch
from dfp_shared import shm_transport
from dfp_shared.rpc import target_pb2 as pb
from dfp_shared.target_client import TargetClient
from dfp_shared.target_wire import HIDDEN_STATES_METHOD

from .support import random_sequences, run

VICTIM_BYTES = 4 << 20


def shm_request(name: str, size: int, token: bytes = b"", seqs=((1, 2, 3),)) -> pb.HiddenStatesRequest:
    flat = torch.cat([torch.tensor(s, dtype=torch.int32) for s in seqs])
    request = pb.HiddenStatesRequest(token_ids=flat.numpy().tobytes(), token_dtype="int32",
                                     lengths=[len(s) for s in seqs], layer_ids=[1])
    request.shm.name, request.shm.size = name, size
    if token:
        request.shm.token = token
    return request


def raw_call(port: int, request: pb.HiddenStatesRequest) -> list[bytes]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(HIDDEN_STATES_METHOD, request_serializer=pb.HiddenStatesRequest.SerializeToString,
                                    response_deserializer=None)
        return list(call(request, timeout=30))


def refused(port: int, request: pb.HiddenStatesRequest) -> str:
    with pytest.raises(grpc.RpcError) as err:
        raw_call(port, request)
    assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED), err.value
    return err.value.details()


def private_dir(shm_dir) -> str:
    return os.path.join(shm_dir, f"dfp-shm-{os.geteuid()}")


def test_symlink_under_a_segment_name_is_not_followed(qwen3_model, tiny_qwen3_dir, make_server, shm_dir, tmp_path):
    server = make_server(qwen3_model, tiny_qwen3_dir, shm_dir=str(shm_dir))
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"V" * VICTIM_BYTES)
    name = "dfp-hs-1-abcdef12-1.seg"
    planted = [os.path.join(d, name) for d in (str(shm_dir), private_dir(shm_dir)) if os.path.isdir(d)]
    for link in planted:
        os.symlink(victim, link)
    details = refused(server.port, shm_request(name, VICTIM_BYTES))
    assert name in details
    assert victim.read_bytes() == b"V" * VICTIM_BYTES


def test_a_client_cannot_name_another_clients_segment(qwen3_model, tiny_qwen3_dir, make_server, shm_dir):
    server = make_server(qwen3_model, tiny_qwen3_dir, shm_dir=str(shm_dir))

    async def go():
        owner = TargetClient(f"127.0.0.1:{server.port}", shm_dir=str(shm_dir))
        try:
            out = await owner.hidden_states(random_sequences([7]), [1])
            seg = owner._pool._all[owner._pool.names()[0]]
            before = bytes(seg.mm[: 1 << 16])
            del out
            details = refused(server.port, shm_request(seg.name, seg.size, seqs=[[9] * 50]))
            assert seg.name in details
            assert bytes(seg.mm[: 1 << 16]) == before  # nothing written
        finally:
            await owner.close()

    run(go())


def test_group_or_world_accessible_segment_directory_is_refused_at_start(qwen3_model, tiny_qwen3_dir, make_server,
                                                                         shm_dir):
    os.mkdir(private_dir(shm_dir))
    os.chmod(private_dir(shm_dir), 0o777)
    with pytest.raises(shm_transport.ShmError) as err:
        make_server(qwen3_model, tiny_qwen3_dir, shm_dir=str(shm_dir))
    assert private_dir(shm_dir) in str(err.value)
