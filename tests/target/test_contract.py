"""The service as ``protos/target.proto`` declares it: the paths the server registers and the client
calls come from the generated descriptor, and the generated stub (``target_pb2_grpc``) gets the same
answers from a running server as the project client."""

from __future__ import annotations

import grpc
import torch
from dfp_shared.hidden_states import TargetClient, info_from_message
from dfp_shared.hidden_states.wire import (
    HIDDEN_STATES_METHOD,
    MODEL_INFO_METHOD,
    SERVICE,
    TARGET_SERVICE,
    pack_tokens,
)
from dfp_shared.rpc import target_pb2 as pb
from dfp_shared.rpc import target_pb2_grpc

from .support import random_sequences, run


class RecordingChannel:
    """Stands in for a channel: records which kind of call the generated stub builds for which path."""

    def __init__(self):
        self.calls: dict[str, str] = {}

    def _record(self, kind: str, path: str):
        self.calls[path] = kind

    def unary_unary(self, path, **_kwargs):
        self._record("unary_unary", path)

    def unary_stream(self, path, **_kwargs):
        self._record("unary_stream", path)

    def stream_unary(self, path, **_kwargs):
        self._record("stream_unary", path)

    def stream_stream(self, path, **_kwargs):
        self._record("stream_stream", path)


def test_paths_are_those_of_the_generated_stub():
    channel = RecordingChannel()
    target_pb2_grpc.TargetServiceStub(channel)
    assert channel.calls == {MODEL_INFO_METHOD: "unary_unary", HIDDEN_STATES_METHOD: "unary_stream"}
    assert all(path.startswith(f"/{SERVICE}/") for path in channel.calls)
    assert len(TARGET_SERVICE.methods) == len(channel.calls)  # every method of the contract is served


def stub_hidden_states(stub, request) -> tuple[list[torch.Tensor], int]:
    """The reply of ``HiddenStates`` parsed by plain protobuf and reassembled by offset; and its chunk count."""
    buffers: dict[int, bytearray] = {}
    heads: dict[int, pb.HiddenStatesChunk] = {}
    done: set[int] = set()
    count = 0
    for chunk in stub.HiddenStates(request, timeout=60):
        count += 1
        if chunk.dtype:
            heads[chunk.sequence] = chunk
            buffers[chunk.sequence] = bytearray(chunk.total_bytes)
        buffers[chunk.sequence][chunk.offset:chunk.offset + len(chunk.data)] = chunk.data
        if chunk.last:
            done.add(chunk.sequence)
    assert done == set(range(len(request.lengths)))
    out = []
    for i in range(len(request.lengths)):
        head = heads[i]
        out.append(torch.frombuffer(buffers[i], dtype=getattr(torch, head.dtype)).view(list(head.shape)))
    return out, count


def test_generated_stub_gets_what_the_client_gets(qwen3_model, tiny_qwen3_dir, make_server):
    server = make_server(qwen3_model, tiny_qwen3_dir, chunk_bytes=4096, layer_ids=[1, 3, 5])
    address = f"127.0.0.1:{server.port}"
    sequences = random_sequences([9, 70, 1, 33], seed=5)
    layers = [5, 1]

    client = TargetClient(address, tokens_per_call=1 << 16)

    async def via_client():
        try:
            return await client.hidden_states(sequences, layers)
        finally:
            await client.close()

    expected = run(via_client())
    tokens, lengths = pack_tokens(sequences)
    request = pb.HiddenStatesRequest(token_ids=tokens, token_dtype="int32", lengths=lengths, layer_ids=layers)
    with grpc.insecure_channel(address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        info = stub.GetModelInfo(pb.ModelInfoRequest(), timeout=30)
        got, chunks = stub_hidden_states(stub, request)

    assert info_from_message(info) == client.model_info()
    assert list(info.layer_ids) == [1, 3, 5] and info.hidden_size == 64
    assert chunks > len(sequences)  # several data chunks per sequence
    assert len(got) == len(expected)
    for seq, g, e in zip(sequences, got, expected):
        assert g.shape == (len(seq), len(layers) * info.hidden_size) and g.dtype == torch.float32
        assert torch.equal(g, e)
