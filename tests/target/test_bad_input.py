"""Bad input gets INVALID_ARGUMENT naming the sequence and the reason; a full queue gets
RESOURCE_EXHAUSTED; the server keeps serving others either way."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from dfp_shared.hidden_states import InvalidInput, TargetClient, forward_batch
from dfp_shared.hidden_states.wire import HIDDEN_STATES_METHOD, decode_chunk
from dfp_shared.rpc import target_pb2 as pb

from .support import random_sequences, run


def raw_call(port: int, request: pb.HiddenStatesRequest) -> list[bytes]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(HIDDEN_STATES_METHOD, request_serializer=pb.HiddenStatesRequest.SerializeToString,
                                    response_deserializer=None)
        return list(call(request, timeout=30))


def ids_request(seqs, layer_ids=(1,), dtype="int32", numbers=()):
    flat = torch.cat([torch.as_tensor(s, dtype=torch.int32) for s in seqs]) if seqs else torch.empty(0, dtype=torch.int32)
    return pb.HiddenStatesRequest(token_ids=flat.numpy().tobytes(), token_dtype=dtype, lengths=[len(s) for s in seqs],
                                  layer_ids=list(layer_ids), sequence_numbers=list(numbers))


@pytest.fixture(scope="module")
def server(qwen3_model, tiny_qwen3_dir):
    from dfp_shared.hidden_states import build_model_info
    from dfp_target.server import TargetServer
    from dfp_target.settings import TargetSettings

    settings = TargetSettings(model=str(tiny_qwen3_dir), host="127.0.0.1", port=0, shm_dir="",
                              max_tokens_per_request=3000)
    info = build_model_info(qwen3_model, tiny_qwen3_dir, layer_ids=[1, 3, 5], max_tokens_per_request=3000)
    srv = TargetServer(settings, info, model=qwen3_model).start()
    yield srv
    srv.stop(grace=1, linger=0)


VOCAB = 151670


@pytest.mark.parametrize("request_args, expected", [
    (dict(seqs=[[1, 2], [3, VOCAB + 5, 4]], numbers=[40, 41]), ["sequence 41", "outside the vocabulary", str(VOCAB + 5)]),
    (dict(seqs=[[5, -3]]), ["sequence 0", "-3", "outside the vocabulary"]),
    (dict(seqs=[[1, 2], []]), ["sequence 1", "empty"]),
    (dict(seqs=[[1] * 4097]), ["sequence 0", "4097 tokens exceed the maximum sequence length 4096"]),
    (dict(seqs=[[1] * 2000, [2] * 1500]), ["3500 tokens exceeds max_tokens_per_request 3000"]),
    (dict(seqs=[[1, 2]], layer_ids=[1, 2]), ["unknown layer ids [2]", "serves layers [1, 3, 5]"]),
    (dict(seqs=[[1, 2]], dtype="int64"), ["token_dtype must be 'int32'", "int64"]),
])
def test_bad_input_is_invalid_argument_and_server_keeps_serving(server, request_args, expected):
    with pytest.raises(grpc.RpcError) as err:
        raw_call(server.port, ids_request(**request_args))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for words in expected:
        assert words in err.value.details()
    replies = raw_call(server.port, ids_request([[1, 2, 3]], layer_ids=[3]))
    header, data = decode_chunk(replies[0])
    assert list(header.shape) == [3, 64] and header.last and len(data) == 3 * 64 * 4


def test_token_bytes_not_matching_lengths(server):
    request = ids_request([[1, 2, 3]])
    request.lengths[:] = [2, 2]
    with pytest.raises(grpc.RpcError) as err:
        raw_call(server.port, request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids holds 12 bytes but lengths [2, 2] need 16" in err.value.details()


def test_client_raises_invalid_input_naming_the_sequence(server):
    async def go():
        client = TargetClient(f"127.0.0.1:{server.port}")
        try:
            with pytest.raises(InvalidInput, match="sequence 1: token id 151670"):
                await client.hidden_states([torch.tensor([1, 2]), torch.tensor([3, VOCAB])], [1])
            return await client.hidden_states([torch.tensor([1, 2], dtype=torch.int32)], [5])
        finally:
            await client.close()

    assert run(go())[0].shape == (2, 64)


def test_full_queue_is_resource_exhausted_then_client_retries(qwen3_model, tiny_qwen3_dir, make_server):
    gate = threading.Event()
    entered = threading.Event()

    def gated_run(seqs, layers):
        entered.set()
        gate.wait(30)
        return forward_batch(qwen3_model, seqs, layers)

    server = make_server(qwen3_model, tiny_qwen3_dir, run=gated_run, max_queue_tokens=100, max_wait_ms=0)
    first = threading.Thread(target=raw_call, args=(server.port, ids_request([[1] * 80])))
    first.start()
    assert entered.wait(20)  # the batcher is busy with the first call
    second = threading.Thread(target=raw_call, args=(server.port, ids_request([[2] * 90])))
    second.start()
    assert wait_for(lambda: server.batcher.queued_tokens() == 90)
    with pytest.raises(grpc.RpcError) as err:
        raw_call(server.port, ids_request([[3] * 20]))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in err.value.details()

    client = TargetClient(f"127.0.0.1:{server.port}", backoff_initial_s=0.05, backoff_max_s=0.2)
    releaser = threading.Thread(target=lambda: (wait_for(lambda: client.stats["retries"] >= 1), gate.set()))
    releaser.start()  # the queue drains only once the client has been refused at least once

    async def retrying_client():
        try:
            return await client.hidden_states(random_sequences([20]), [1])
        finally:
            await client.close()

    (out,) = run(retrying_client())
    releaser.join(10)
    stats = client.stats
    first.join(10)
    second.join(10)
    assert stats["retries"] >= 1
    assert torch.equal(out, forward_batch(qwen3_model, random_sequences([20]), [1])[0])


def wait_for(predicate, timeout=10.0):
    from .support import wait_until

    return wait_until(predicate, timeout)
