"""What a loaded target serves, that description on the wire both ways, and the gRPC options of both ends."""

from __future__ import annotations

import functools
from dataclasses import fields
from pathlib import Path

from dfp_shared.hidden_states.contract import ModelInfo
from dfp_shared.hidden_states.tensor_codec import dtype_name
from dfp_shared.models.loading import model_fingerprint, text_config
from dfp_shared.rpc import target_pb2 as pb

_WIRE_FIELDS = [f.name for f in fields(ModelInfo) if f.name != "extra"]


def build_model_info(model, model_dir: str | Path, *, model_id: str | None = None, layer_ids: list[int] | None = None,
                     max_tokens_per_request: int = 65536, max_message_bytes: int = 0) -> ModelInfo:
    """Describe a loaded model: the served layers default to every decoder layer."""
    cfg = text_config(model.config)
    num_layers = int(cfg.num_hidden_layers)
    served = sorted(set(layer_ids)) if layer_ids else list(range(num_layers))
    bad = [i for i in served if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} do not exist in a model with {num_layers} layers")
    path = Path(model_dir)
    return ModelInfo(
        model_id=model_id or path.name,
        fingerprint=model_fingerprint(path),
        num_layers=num_layers,
        hidden_size=int(cfg.hidden_size),
        vocab_size=int(cfg.vocab_size),
        dtype=dtype_name(next(model.parameters()).dtype),
        layer_ids=served,
        max_tokens_per_request=max_tokens_per_request,
        tokenizer_fingerprint=_tokenizer_fingerprint(str(path.resolve())),
        max_sequence_length=int(getattr(cfg, "max_position_embeddings", 0) or 0),
        max_message_bytes=max_message_bytes,
    )


@functools.lru_cache(maxsize=16)
def _tokenizer_fingerprint(path: str) -> str:
    """Fingerprint of the tokenizer saved beside the checkpoint ("" when there is none)."""
    if not (Path(path) / "tokenizer.json").exists() and not (Path(path) / "tokenizer_config.json").exists():
        return ""
    from dfp_shared.models.tokenizer_assets import load_tokenizer, tokenizer_fingerprint

    return tokenizer_fingerprint(load_tokenizer(path))


def info_to_message(info: ModelInfo) -> pb.ModelInfo:
    """The ``GetModelInfo`` reply: every field but ``extra``."""
    return pb.ModelInfo(**{name: getattr(info, name) for name in _WIRE_FIELDS})


def info_from_message(msg: pb.ModelInfo) -> ModelInfo:
    values = {name: getattr(msg, name) for name in _WIRE_FIELDS}
    values["layer_ids"] = list(msg.layer_ids)
    return ModelInfo(**values)


def _message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Tuned for large streamed tensors (see the hidden-states benchmark)."""
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.http2.max_frame_size", 16777215)]


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """A client channel's options: the client retries itself and reconnects quickly."""
    return _message_options(max_message_bytes) + [
        ("grpc.enable_retries", 0),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        ("grpc.use_local_subchannel_pool", 1)]


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The target server's options: one server per port."""
    return _message_options(max_message_bytes) + [("grpc.so_reuseport", 0)]
