"""Files and functions a hostile user's job would feed a worker: GGUF headers that claim more than they hold,
and work that allocates or runs without end (run in a confined child by the tests)."""

from __future__ import annotations

import struct
import time
from pathlib import Path


def _kv_array(key: bytes, item_type: int, count: int) -> bytes:
    return struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, item_type, count)


def write_endless_array_gguf(path: Path) -> Path:
    """94 bytes: a GGUF v3 header with one metadata array of uint8 claiming 2^63 elements."""
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _kv_array(b"general.architecture", 0, 2**63)
    path.write_bytes(data + b"\0" * (94 - len(data)))
    return path


def write_twin_tensor_gguf(path: Path, name: str) -> Path:
    """A GGUF with two tensors named ``name`` (one float32 element each) and an architecture."""
    arch = b"general.architecture"
    header = b"GGUF" + struct.pack("<IQQ", 3, 2, 1) + struct.pack("<Q", len(arch)) + arch
    header += struct.pack("<IQ", 8, 5) + b"llama"
    raw = name.encode()
    for offset in (0, 32):
        header += struct.pack("<Q", len(raw)) + raw + struct.pack("<IQIQ", 1, 1, 0, offset)
    header += b"\0" * (-len(header) % 32)
    path.write_bytes(header + b"\0" * 64)
    return path


def grow_without_end(step_mb: int = 16) -> int:
    """Allocate (and touch) ``step_mb`` MiB after another until something stops it."""
    held = []
    while True:
        held.append(bytearray(step_mb << 20))
        held[-1][::4096] = b"\1" * len(range(0, step_mb << 20, 4096))


def sleep_without_end() -> None:
    while True:
        time.sleep(1)


def read_with_gguf_reader(path: str) -> int:
    """gguf's own reader on ``path``, as transformers uses it: it believes every count the header claims."""
    from gguf import GGUFReader

    return len(GGUFReader(path).fields)
