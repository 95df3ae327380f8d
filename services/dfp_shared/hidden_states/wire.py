"""Wire helpers of the target service: token packing, and tensor chunks encoded and decoded with one copy.

A ``HiddenStatesChunk`` is an ordinary protobuf message. The sender writes its small header with
protobuf and appends the ``data`` field (number 15) itself, so the tensor bytes are copied once
into the outgoing message instead of twice. The receiver walks the top-level fields, hands the
header to protobuf and keeps ``data`` as a ``memoryview`` slice of the received message, which it
copies straight into the sequence's preallocated buffer. Both sides stay wire-compatible with any
protobuf implementation.
"""

from __future__ import annotations

import torch

from dfp_shared.hidden_states.tensor_codec import CodecError, decode_tensor, dtype_name, tensor_bytes
from dfp_shared.rpc import target_pb2 as pb

# Names come from the descriptor generated from protos/target.proto, so server, client, health and
# reflection follow the contract (a renamed service or method fails here, at import).
TARGET_SERVICE = pb.DESCRIPTOR.services_by_name["TargetService"]
SERVICE = TARGET_SERVICE.full_name
MODEL_INFO = TARGET_SERVICE.methods_by_name["GetModelInfo"]
HIDDEN_STATES = TARGET_SERVICE.methods_by_name["HiddenStates"]


def method_path(method) -> str:
    """The HTTP/2 path of a method (``/<package>.<Service>/<Method>``), as the generated stub calls it."""
    return f"/{method.containing_service.full_name}/{method.name}"


MODEL_INFO_METHOD = method_path(MODEL_INFO)
HIDDEN_STATES_METHOD = method_path(HIDDEN_STATES)
DATA_FIELD = 15
_DATA_TAG = bytes([(DATA_FIELD << 3) | 2])


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise CodecError("malformed varint in a chunk")


def encode_chunk(header: pb.HiddenStatesChunk, data=None) -> bytes:
    """Serialized ``header`` with ``data`` (bytes-like, copied once) as field 15."""
    head = header.SerializeToString()
    if data is None or len(data) == 0:
        return head
    return b"".join((head, _DATA_TAG, _varint(len(data)), data))


def decode_chunk(message: bytes) -> tuple[pb.HiddenStatesChunk, memoryview]:
    """Header and a zero-copy view of the data field of a serialized ``HiddenStatesChunk``."""
    view = memoryview(message)
    pos, end = 0, len(message)
    data = view[0:0]
    head_parts = []
    start = 0
    while pos < end:
        field_start = pos
        key, pos = _read_varint(message, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _read_varint(message, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            size, pos = _read_varint(message, pos)
            if key >> 3 == DATA_FIELD:
                data = view[pos:pos + size]
                head_parts.append(message[start:field_start])
                start = pos + size
            pos += size
        else:
            raise CodecError(f"unexpected wire type {wire} in a chunk")
    head_parts.append(message[start:end] if start < end else b"")
    header = pb.HiddenStatesChunk.FromString(b"".join(head_parts) if len(head_parts) > 1 else message)
    return header, data


def tensor_chunks(sequence: int, tensor: torch.Tensor, chunk_bytes: int):
    """Encoded chunks of one sequence's tensor, each holding at most ``chunk_bytes`` of data."""
    view = tensor_bytes(tensor)
    total = len(view)
    first = True
    for start in range(0, max(total, 1), chunk_bytes):
        piece = view[start:start + chunk_bytes]
        last = start + chunk_bytes >= total
        if first:
            header = pb.HiddenStatesChunk(sequence=sequence, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape),
                                          total_bytes=total, offset=start, last=last)
            first = False
        else:
            header = pb.HiddenStatesChunk(sequence=sequence, offset=start, last=last)
        yield encode_chunk(header, piece)


def pack_tokens(sequences: list[torch.Tensor]) -> tuple[bytes, list[int]]:
    """Concatenated int32 bytes of the sequences and their lengths."""
    lengths = [int(s.numel()) for s in sequences]
    if not sequences:
        return b"", lengths
    flat = torch.cat([s.reshape(-1).to(torch.int32) for s in sequences])
    return bytes(tensor_bytes(flat)), lengths


def unpack_tokens(request: pb.HiddenStatesRequest) -> list[torch.Tensor]:
    """The request's sequences as int32 tensors; raises ``ValueError`` naming what is wrong."""
    if request.token_dtype != "int32":
        raise ValueError(f"token_dtype must be 'int32', got {request.token_dtype!r}")
    lengths = list(request.lengths)
    numbers = list(request.sequence_numbers) or list(range(len(lengths)))
    if len(numbers) != len(lengths):
        raise ValueError(f"{len(numbers)} sequence_numbers for {len(lengths)} sequences")
    for n, length in zip(numbers, lengths):
        if length < 0:
            raise ValueError(f"sequence {n}: negative length {length}")
    total = sum(lengths)
    if len(request.token_ids) != total * 4:
        raise ValueError(f"token_ids holds {len(request.token_ids)} bytes but lengths {lengths} need {total * 4} "
                         "(4 bytes per int32 id)")
    flat = decode_tensor(request.token_ids, "int32", [total]) if total else torch.empty(0, dtype=torch.int32)
    return list(torch.split(flat, lengths)) if lengths else []


class SequenceAssembler:
    """Reassembles one sequence's chunks into a preallocated bytearray; ``tensor()`` views it (no copy)."""

    def __init__(self, header: pb.HiddenStatesChunk):
        self.dtype = header.dtype
        self.shape = list(header.shape)
        self.total = int(header.total_bytes)
        self.buffer = bytearray(self.total)
        self.received = 0

    def add(self, header: pb.HiddenStatesChunk, data: memoryview) -> bool:
        end = header.offset + len(data)
        if end > self.total:
            raise CodecError(f"chunk [{header.offset}, {end}) overruns a {self.total}-byte tensor")
        self.buffer[header.offset:end] = data
        self.received += len(data)
        return header.last

    def tensor(self) -> torch.Tensor:
        if self.received != self.total:
            raise CodecError(f"sequence incomplete: {self.received} of {self.total} bytes")
        return decode_tensor(self.buffer, self.dtype, self.shape)
