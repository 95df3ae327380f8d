"""Hidden states of a frozen target model: the contract, its sources (and their cache), and the target service's wire.

The trainer asks a :class:`HiddenStateSource` (``open_hidden_state_source``: the in-process
target or a client of the target service); the target service runs :func:`forward_batch` behind
the same wire. Tests may import the submodules; services import from here.
"""

from dfp_shared.hidden_states.cache import (
    CacheError,
    CacheKey,
    CacheMismatch,
    HiddenStateCache,
    dataset_checksum,
    estimate_bytes,
)
from dfp_shared.hidden_states.cached_source import CachedSource, fill_shards
from dfp_shared.hidden_states.client import TargetClient, open_hidden_state_source
from dfp_shared.hidden_states.contract import (
    HiddenStateSource,
    InvalidInput,
    ModelInfo,
    SourceUnavailable,
    resolve_layers,
    validate_sequences,
)
from dfp_shared.hidden_states.forward import forward_batch
from dfp_shared.hidden_states.local import InProcessTarget
from dfp_shared.hidden_states.model_info import (
    build_model_info,
    channel_options,
    info_from_message,
    info_to_message,
    server_options,
)
from dfp_shared.hidden_states.packing import pad_batch, padded_batches, plan_batches, plan_requests
from dfp_shared.hidden_states.shm_transport import HEADER_BYTES as SHM_HEADER_BYTES
from dfp_shared.hidden_states.shm_transport import PrivateDir, SegmentCache, ShmError
from dfp_shared.hidden_states.tensor_codec import CodecError, dtype_name, to_dtype
from dfp_shared.hidden_states.wire import (
    HIDDEN_STATES,
    MODEL_INFO,
    SERVICE,
    encode_chunk,
    tensor_chunks,
    unpack_tokens,
)

__all__ = [
    # the contract and its sources
    "HiddenStateSource", "InProcessTarget", "InvalidInput", "ModelInfo", "SourceUnavailable", "TargetClient",
    "open_hidden_state_source", "resolve_layers", "validate_sequences",
    # the hidden-state cache
    "CacheError", "CacheKey", "CacheMismatch", "CachedSource", "HiddenStateCache", "dataset_checksum",
    "estimate_bytes", "fill_shards",
    # the forward pass, batching and the model's description
    "build_model_info", "forward_batch", "pad_batch", "padded_batches", "plan_batches", "plan_requests",
    # the target service's side of the wire
    "CodecError", "HIDDEN_STATES", "MODEL_INFO", "PrivateDir", "SERVICE", "SHM_HEADER_BYTES", "SegmentCache",
    "ShmError", "channel_options", "dtype_name", "encode_chunk", "info_from_message", "info_to_message",
    "server_options", "tensor_chunks", "to_dtype", "unpack_tokens",
]
