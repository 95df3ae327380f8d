from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

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
    def __init__(self, model_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., layer_ids: _Optional[_Iterable[int]] = ..., max_tokens_per_request: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_sequence_length: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class ShmTarget(_message.Message):
    __slots__ = ("name", "size", "token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    token: bytes
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

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
    def __init__(self, token_ids: _Optional[bytes] = ..., token_dtype: _Optional[str] = ..., lengths: _Optional[_Iterable[int]] = ..., layer_ids: _Optional[_Iterable[int]] = ..., sequence_numbers: _Optional[_Iterable[int]] = ..., shm: _Optional[_Union[ShmTarget, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

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
    def __init__(self, sequence: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., last: _Optional[bool] = ..., shm_offset: _Optional[int] = ..., in_shm: _Optional[bool] = ..., data: _Optional[bytes] = ...) -> None: ...
