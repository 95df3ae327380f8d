from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers

DESCRIPTOR: _descriptor.FileDescriptor

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "fingerprint", "num_layers", "hidden_size", "vocab_size", "dtype", "layer_ids", "max_tokens_per_request", "tokenizer_fingerprint", "max_sequence_length", "max_message_bytes")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    fingerprint: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str
    layer_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens_per_request: int
    tokenizer_fingerprint: str
    max_sequence_length: int
    max_message_bytes: int
    def __init__(self, model_id: str | None = ..., fingerprint: str | None = ..., num_layers: int | None = ..., hidden_size: int | None = ..., vocab_size: int | None = ..., dtype: str | None = ..., layer_ids: _Iterable[int] | None = ..., max_tokens_per_request: int | None = ..., tokenizer_fingerprint: str | None = ..., max_sequence_length: int | None = ..., max_message_bytes: int | None = ...) -> None: ...

class ShmTarget(_message.Message):
    __slots__ = ("name", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    def __init__(self, name: str | None = ..., size: int | None = ...) -> None: ...

class HiddenStatesRequest(_message.Message):
    __slots__ = ("token_ids", "token_dtype", "lengths", "layer_ids", "sequence_numbers", "shm", "request_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_NUMBERS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: bytes
    token_dtype: str
    lengths: _containers.RepeatedScalarFieldContainer[int]
    layer_ids: _containers.RepeatedScalarFieldContainer[int]
    sequence_numbers: _containers.RepeatedScalarFieldContainer[int]
    shm: ShmTarget
    request_id: str
    def __init__(self, token_ids: bytes | None = ..., token_dtype: str | None = ..., lengths: _Iterable[int] | None = ..., layer_ids: _Iterable[int] | None = ..., sequence_numbers: _Iterable[int] | None = ..., shm: ShmTarget | _Mapping | None = ..., request_id: str | None = ...) -> None: ...

class HiddenStatesChunk(_message.Message):
    __slots__ = ("sequence", "dtype", "shape", "total_bytes", "offset", "last", "shm_offset", "in_shm", "data")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    IN_SHM_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    total_bytes: int
    offset: int
    last: bool
    shm_offset: int
    in_shm: bool
    data: bytes
    def __init__(self, sequence: int | None = ..., dtype: str | None = ..., shape: _Iterable[int] | None = ..., total_bytes: int | None = ..., offset: int | None = ..., last: bool | None = ..., shm_offset: int | None = ..., in_shm: bool | None = ..., data: bytes | None = ...) -> None: ...
