"""A GGUF file's header read under the file's own bytes: every count it claims is bounded by what is left.

A GGUF header is a list of claims: string lengths, array counts, tensor dimensions and offsets. A reader
that believes a claim before checking it against the file loops or allocates in proportion to the claim
(a 94-byte file whose one ``uint8`` array claims 2^63 elements grows a process by 100 MB/s). :func:`scan`
walks the whole header with :mod:`struct` over a memory map and refuses, naming the field, any string or
array longer than the bytes that remain, any nested array, any tensor with more than :data:`MAX_DIMS`
dimensions, two tensors of one name, and any tensor whose data would lie past the end of the file. Only
then do the parsers that believe the header (gguf's ``GGUFReader``, transformers) see the file.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dfp_shared.printable import printable

MAX_KEY_BYTES = 1 << 16
MAX_NAME_BYTES = 1 << 16
MAX_VALUE_BYTES = 1 << 20  # a longer metadata string is skipped (its length kept), never read into memory
CHECK_EVERY = 1 << 16  # entries, strings or tensors between two calls of ``check``
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class HeaderError(ValueError):
    """A header claim the file's bytes cannot hold (the message names the field, not the file)."""


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict  # scalars and strings (arrays: their length only)
    tensors: dict[str, tuple[tuple[int, ...], int]]  # name -> (shape, ggml type)
    data_offset: int


class _Cursor:
    def __init__(self, buf, size: int, check: Callable[[], None] | None):
        self.buf, self.size, self.at, self.steps = buf, size, 0, 0
        self.check = check

    def step(self) -> None:
        self.steps += 1
        if self.check is not None and self.steps % CHECK_EVERY == 0:
            self.check()

    def left(self) -> int:
        return self.size - self.at

    def take(self, fmt: str, what: str):
        width = struct.calcsize("<" + fmt)
        if width > self.left():
            raise HeaderError(f"{what}: the file ends at byte {self.size:,}, inside it")
        value = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += width
        return value[0] if len(value) == 1 else value

    def string(self, what: str, limit: int | None = None, keep: int = MAX_VALUE_BYTES) -> str | int:
        """The next string (at most ``limit`` bytes), or its length when longer than ``keep``."""
        self.step()
        length = self.take("Q", what)
        if length > self.left() or (limit is not None and length > limit):
            raise HeaderError(f"{what}: claims a string of {length:,} bytes, more than the "
                              f"{min(self.left(), limit or self.left()):,} it may hold")
        start, self.at = self.at, self.at + length
        return bytes(self.buf[start:self.at]).decode("utf-8", errors="replace") if length <= keep else length

    def skip(self, count: int, width: int, what: str) -> None:
        if count > self.left() // max(1, width):
            raise HeaderError(f"{what}: claims {count:,} elements of {width} bytes, more than the "
                              f"{self.left():,} bytes left in the file")
        self.at += count * width


def _value(cur: _Cursor, kind: int, what: str):
    if kind in _SCALARS:
        return cur.take(_SCALARS[kind], what)
    if kind == STRING:
        return cur.string(what)
    if kind != ARRAY:
        raise HeaderError(f"{what}: unknown value type {kind}")
    item, count = cur.take("I", what), cur.take("Q", what)
    if item == ARRAY:
        raise HeaderError(f"{what}: an array of arrays is not read")
    if item == STRING:
        if count > cur.left() // 8:  # every string takes at least its 8-byte length
            raise HeaderError(f"{what}: claims {count:,} strings, more than the {cur.left():,} bytes left hold")
        for i in range(count):
            cur.string(f"{what}[{i}]", keep=0)
    elif item in _SCALARS:
        cur.skip(count, struct.calcsize("<" + _SCALARS[item]), what)
    else:
        raise HeaderError(f"{what}: unknown array element type {item}")
    return count


def _tensor_bytes(shape: tuple[int, ...], kind: int, what: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, width = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise HeaderError(f"{what}: unknown tensor type {kind}") from None
    elements = 1
    for dim in shape:
        elements *= dim
    if shape and shape[0] % block:
        raise HeaderError(f"{what}: a row of {shape[0]} elements is not whole blocks of {block}")
    return elements // block * width


def scan(path: str | Path, max_tensors: int, max_metadata: int, check: Callable[[], None] | None = None) -> Header:
    """The header of the GGUF file at ``path``, every claim checked against the file's bytes (see the module);
    raises :class:`HeaderError` naming the field. Memory stays within a few times ``MAX_VALUE_BYTES`` plus the
    entries' and tensors' names; ``check`` is called every :data:`CHECK_EVERY` items (what it raises propagates)."""
    with open(path, "rb") as fh:
        size = Path(path).stat().st_size
        if size < 24:
            raise HeaderError(f"{size} bytes: too short for a GGUF header")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _scan(_Cursor(buf, size, check), max_tensors, max_metadata)


def _scan(cur: _Cursor, max_tensors: int, max_metadata: int) -> Header:
    _magic, version, n_tensors, n_metadata = cur.take("4sIQQ", "header")
    if n_tensors > max_tensors or n_metadata > max_metadata:
        raise HeaderError(f"header claims {n_tensors:,} tensors and {n_metadata:,} metadata entries "
                          f"(at most {max_tensors:,} and {max_metadata:,})")
    metadata: dict = {}
    for i in range(n_metadata):
        key = str(cur.string(f"metadata entry {i}: key", MAX_KEY_BYTES))
        what = f"metadata {printable(key, keep_newlines=False)!r}"
        metadata[key] = _value(cur, cur.take("I", what), what)
    tensors: dict[str, tuple[tuple[int, ...], int]] = {}
    offsets = []
    for i in range(n_tensors):
        name = str(cur.string(f"tensor {i}: name", MAX_NAME_BYTES))
        what = f"tensor {printable(name, keep_newlines=False)!r}"
        if name in tensors:
            raise HeaderError(f"{what}: two tensors of this name")
        n_dims = cur.take("I", what)
        if not 1 <= n_dims <= MAX_DIMS:
            raise HeaderError(f"{what}: {n_dims} dimensions (at most {MAX_DIMS})")
        shape = tuple(cur.take("Q", what) for _ in range(n_dims))
        kind, offset = cur.take("I", what), cur.take("Q", what)
        tensors[name] = (shape, kind)
        offsets.append((what, offset, _tensor_bytes(shape, kind, what)))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise HeaderError(f"general.alignment {alignment!r} is not a power of two")
    data_offset = -(-cur.at // alignment) * alignment
    for what, offset, nbytes in offsets:
        if offset > cur.size or nbytes > cur.size - data_offset - offset:
            raise HeaderError(f"{what}: {nbytes:,} bytes at offset {offset:,} lie past the end of the file "
                              f"({cur.size - data_offset:,} bytes of tensor data)")
    return Header(version=version, metadata=metadata, tensors=tensors, data_offset=data_offset)
