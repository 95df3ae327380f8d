"""Tensors on the wire: raw little-endian bytes with a dtype name and a shape (never repeated floats)."""

from __future__ import annotations

import sys

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
NAMES = {v: k for k, v in DTYPES.items()}

assert sys.byteorder == "little", "the wire format is little-endian; big-endian hosts are not supported"


class CodecError(ValueError):
    pass


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return NAMES[dtype]
    except KeyError:
        raise CodecError(f"unsupported dtype {dtype}") from None


def to_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise CodecError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy when it is contiguous on the CPU."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def decode_tensor(buf, dtype: str, shape) -> torch.Tensor:
    """A tensor viewing ``buf`` (bytes, bytearray or memoryview) with no copy; validates the size."""
    dt = to_dtype(dtype)
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        numel *= s
    expected = numel * torch.empty((), dtype=dt).element_size()
    if len(buf) != expected:
        raise CodecError(f"{len(buf)} bytes do not hold a {dtype} tensor of shape {list(shape)} ({expected} bytes)")
    if numel == 0:
        return torch.empty(shape, dtype=dt)
    if isinstance(buf, bytes):  # frombuffer wants a writable buffer to avoid a warning; bytes are read-only
        buf = bytearray(buf)
    return torch.frombuffer(buf, dtype=dt).view(shape)


def chunks(view: memoryview, chunk_bytes: int):
    """Slices of ``view`` of at most ``chunk_bytes`` each (zero-copy)."""
    for start in range(0, max(len(view), 1), chunk_bytes):
        yield view[start:start + chunk_bytes]
