"""One input file to one token shard: read records, parse, render, tokenize in batches, write.

Input files are JSON Lines (read line by line, as bytes in memory) or, streamed through the shared
record readers (:mod:`dfp_shared.record_sources`), a JSON array of records, a Parquet file or an
Arrow file of a ``datasets`` ``save_to_disk`` directory. The result holds the encoded shard
(``dfp_shared.records.token_shards`` format), its manifest entry, the bad records (file, line / record /
row, reason) and the file's statistics, which the job's finalize step merges into ``stats.json``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
from dfp_shared import record_sources as sources
from dfp_shared.jobs.worker import TaskCancelled, TaskReleased
from dfp_shared.records.token_shards import encode_shard, shard_entry
from dfp_shared.storage.store import ObjectStore

from .encoder import Encoded, Prepared, SampleEncoder
from .limits import DEFAULT_MAX_LINE_BYTES
from .records import (
    BLANK_LINE,
    DUPLICATE_ID,
    LINE_TOO_LONG,
    MALFORMED_JSON,
    Sample,
    SampleError,
    parse_line,
    parse_record,
    short_detail,
)

INPUT_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".ndjson", ".json", ".parquet", ".arrow")
# sample length histogram: bucket i counts lengths in [EDGES[i], EDGES[i+1])
HIST_EDGES = [0] + [2**k for k in range(5, 18)] + [2**62]
CHECK_S = 1.0
ID_CHARS = 200


class FileUnreadable(Exception):
    """The whole file cannot be read (missing, corrupt compression): the task fails and is retried."""


def listed_inputs(store: ObjectStore, keys: list[str]) -> list[str]:
    """The input files among the keys listed under an input prefix.

    A plain ``.json`` file there counts only if it holds a JSON array of records: a prefix may hold
    other JSON files (manifests, plans) that were never inputs. A file named on its own is read
    whatever it holds.
    """
    from concurrent.futures import ThreadPoolExecutor

    keys = sources.select_inputs(keys, INPUT_SUFFIXES)
    plain = [k for k in keys if k.endswith(".json")]
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(plain)))) as pool:
        formats = pool.map(lambda k: sources.detect_format(store, k), plain)
        arrays = {k for k, fmt in zip(plain, formats) if fmt == sources.JSON_ARRAY}
    return [k for k in keys if not k.endswith(".json") or k in arrays]


def shard_name(rel_key: str) -> str:
    """Deterministic shard name of an input key: readable stem plus a hash of the full key."""
    stem = rel_key
    for suffix in INPUT_SUFFIXES:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", stem.replace("/", "--")).strip("._-")[-80:] or "input"
    return f"{stem}-{hashlib.sha1(rel_key.encode()).hexdigest()[:8]}"


def read_lines(data: bytes, uri: str, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[tuple[int, bytes | None]]:
    """``(line number, line)`` of every line; ``None`` for a line longer than ``max_line_bytes``,
    which is skipped without being copied (or, compressed, without being decompressed whole)."""
    if uri.endswith(".gz") or data[:2] == b"\x1f\x8b":
        yield from _gzip_lines(data, uri, max_line_bytes)
        return
    pos, lineno = 0, 0
    n = len(data) - 1 if data.endswith(b"\n") else len(data)  # a final newline ends the last line, starts none
    while data and pos <= n:
        end = data.find(b"\n", pos)
        end = n if end < 0 else end
        lineno += 1
        yield lineno, (data[pos:end] if end - pos <= max_line_bytes else None)
        pos = end + 1


def _gzip_lines(data: bytes, uri: str, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    lineno = 0
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
            while True:
                line = f.readline(max_line_bytes + 1)
                if not line:
                    return
                lineno += 1
                if len(line) <= max_line_bytes or (len(line) == max_line_bytes + 1 and line.endswith(b"\n")):
                    yield lineno, line.rstrip(b"\n")
                    continue
                while line and not line.endswith(b"\n"):  # the rest of an over-long line, in pieces
                    line = f.readline(1 << 20)
                yield lineno, None
    except (OSError, EOFError, zlib.error) as exc:
        raise FileUnreadable(f"{uri}: not a readable gzip file ({exc})") from None


@dataclass
class FileStats:
    lines: int = 0
    """Records read (lines, array records or rows)."""
    samples: int = 0
    errors: Counter = field(default_factory=Counter)
    """Records not tokenized, by reason."""
    tokens: int = 0
    trained_tokens: int = 0
    """Tokens in the loss mask."""
    truncated: int = 0
    duplicate_ids: int = 0
    """Lines kept although an earlier line of the file has their sample id."""
    histogram: list[int] = field(default_factory=lambda: [0] * (len(HIST_EDGES) - 1))
    max_length: int = 0

    def to_dict(self) -> dict:
        return {"lines": self.lines, "samples": self.samples, "tokens": self.tokens,
                "trained_tokens": self.trained_tokens, "truncated": self.truncated, "duplicate_ids": self.duplicate_ids,
                "bad_lines": sum(self.errors.values()), "errors": dict(self.errors),
                "length_histogram": self.histogram, "max_length": self.max_length}


@dataclass
class FileResult:
    shard: bytes
    entry: dict
    errors: list[dict]
    stats: FileStats


def tokenize_input(store: ObjectStore, key: str, uri: str, shard_key: str, encoder: SampleEncoder, *,
                   id_prefix: str, check: Callable[[], None] | None = None) -> FileResult:
    """Tokenize one input file of ``store`` whatever its format (see :func:`tokenize_file`).

    A JSON Lines file is read whole, as it always was; other files are streamed record by record, a
    JSON-array record larger than the line limit being one ``record_too_long`` bad record.
    """
    fmt = sources.detect_format(store, key)
    if fmt == sources.LINES:
        data = store.get(key)
        if check:
            check()
        return tokenize_file(data, uri, shard_key, encoder, id_prefix=id_prefix, check=check)
    items = sources.iter_records(store, key, fmt, max_record_bytes=encoder.limits.max_line_bytes)
    return tokenize_items(items, uri, shard_key, encoder, id_prefix=id_prefix, unit=sources.unit_of(fmt), check=check)


def tokenize_file(data: bytes, uri: str, shard_key: str, encoder: SampleEncoder, *, id_prefix: str,
                  check: Callable[[], None] | None = None) -> FileResult:
    """Tokenize every line of one JSON Lines input file (bytes) into one shard.

    ``id_prefix`` names samples without an ``id`` (``<id_prefix>:<line>``); ``check`` is called
    between batches, at least every ``CHECK_S`` between records, and by the render watchdog during a
    render (raises to abandon the file, e.g. on cancel). Whatever goes wrong with one record makes it
    a bad line; only an unreadable file (or ``check``) ends the call early.
    """
    items = read_lines(data, uri, encoder.limits.max_line_bytes)
    return tokenize_items(items, uri, shard_key, encoder, id_prefix=id_prefix, unit="line", check=check)


def tokenize_items(items: Iterator[tuple[int, object]], uri: str, shard_key: str, encoder: SampleEncoder, *,
                   id_prefix: str, unit: str, check: Callable[[], None] | None = None) -> FileResult:
    """Tokenize the records of one file into one shard.

    ``items`` yields ``(position, item)``: a JSON line (bytes), None for an over-long line, a decoded
    record, or a :class:`~dfp_shared.record_sources.RecordError`. ``unit`` names what the positions
    count (``line``, ``record``, ``row``) in the errors; a sample without an ``id`` is
    ``<id_prefix>:<line>`` or ``<id_prefix>#<position>``.
    """
    out = _Outputs(uri, unit)
    stats, bad = out.stats, out.bad
    batch: list[Prepared] = []
    batch_lines: list[int] = []
    batch_chars = 0
    pending: list[tuple[int, Sample]] = []  # parsed, to be rendered together in the render process
    pending_chars = 0

    def render() -> None:
        nonlocal pending_chars, batch_chars
        for (lineno, _), res in zip(pending, encoder.prepare_many([s for _, s in pending], check=check)):
            if isinstance(res, SampleError):
                bad(lineno, res)
                continue
            batch.append(res)
            batch_lines.append(lineno)
            batch_chars += len(res.text)
            if batch_chars >= max_chars:
                flush()
        pending.clear()
        pending_chars = 0

    def flush() -> None:
        nonlocal batch_chars
        batch_chars = 0
        for lineno, res in zip(batch_lines, encoder.encode(batch)):
            if isinstance(res, SampleError):
                bad(lineno, res)
                continue
            out.keep(res)
        batch.clear()
        batch_lines.clear()
        if check:
            check()

    max_line, max_chars = encoder.limits.max_line_bytes, encoder.limits.max_batch_chars
    checked = time.monotonic()
    for lineno, line in items:
        stats.lines += 1
        unreadable = _unreadable(line, max_line)
        if unreadable is not None:
            bad(lineno, unreadable)
            continue
        try:
            sample = _parse(line, lineno, id_prefix, unit)
            out.unique(lineno, sample, drop=encoder.spec.duplicate_ids == "drop")
            pending.append((lineno, sample))
            pending_chars += sample_chars(sample)
        except SampleError as exc:
            bad(lineno, exc)
        except (TaskCancelled, TaskReleased):
            raise
        except Exception as exc:  # noqa: BLE001 - one record's failure, whatever it is, is one bad line
            bad(lineno, SampleError(MALFORMED_JSON, f"{type(exc).__name__} while reading the record"))
        if len(pending) >= encoder.spec.samples_per_batch or pending_chars >= max_chars:
            render()
            flush()
            checked = time.monotonic()
        elif check and time.monotonic() - checked > CHECK_S:
            check()
            checked = time.monotonic()
    render()
    flush()
    return out.result(shard_key, encoder)


def _parse(line, lineno: int, id_prefix: str, unit: str) -> Sample:
    """The sample of a JSON line (bytes) or a decoded record; one without an id gets its place in the file."""
    if isinstance(line, bytes):
        return parse_line(line, f"{id_prefix}:{lineno}")
    return parse_record(line, f"{id_prefix}:{lineno}" if unit == "line" else f"{id_prefix}#{lineno}")


def _unreadable(line, max_line: int) -> SampleError | None:
    """Why an item cannot be parsed before it is: an over-long line (None), a record source's error, a blank line."""
    if line is None:
        return SampleError(LINE_TOO_LONG, f"line longer than the limit of {max_line} bytes")
    if isinstance(line, sources.RecordError):
        return SampleError(line.code, line.reason)
    if isinstance(line, bytes) and not line.strip():
        return SampleError(BLANK_LINE, "blank line")
    return None


class _Outputs:
    """What tokenizing one file keeps: the encoded samples, the bad lines' errors, the file's statistics."""

    def __init__(self, uri: str, unit: str) -> None:
        self.uri, self.unit = uri, unit
        self.stats = FileStats()
        self.errors: list[dict] = []
        self.ids: list[str] = []
        self.tokens: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.lengths: list[int] = []
        self.seen_ids: set[str] = set()

    def bad(self, lineno: int, exc: SampleError, kept: bool = False) -> None:
        if not kept:
            self.stats.errors[exc.reason] += 1
        self.errors.append({"file": self.uri, self.unit: lineno, "reason": exc.reason,
                            "detail": short_detail(exc.detail),
                            **({"id": exc.sample_id[:ID_CHARS]} if exc.sample_id else {}),
                            **({"kept": True} if kept else {})})

    def unique(self, lineno: int, sample, drop: bool) -> None:
        """Report a sample id seen before in this file; raise to drop the line when the spec asks (``drop``)."""
        if sample.id not in self.seen_ids:
            self.seen_ids.add(sample.id)
            return
        dup = SampleError(DUPLICATE_ID, "an earlier line of this file has the same sample id", sample.id)
        if drop:
            raise dup
        self.stats.duplicate_ids += 1
        self.bad(lineno, dup, kept=True)

    def keep(self, res: Encoded) -> None:
        self.ids.append(res.sample_id)
        self.tokens.append(res.ids)
        self.masks.append(res.mask)
        self.lengths.append(len(res.ids))
        self.stats.trained_tokens += int(res.mask.sum())
        self.stats.truncated += int(res.truncated)

    def result(self, shard_key: str, encoder: SampleEncoder) -> FileResult:
        stats, lengths = self.stats, self.lengths
        stats.samples = len(self.ids)
        stats.tokens = int(sum(lengths))
        if lengths:
            counts, _ = np.histogram(np.asarray(lengths), bins=HIST_EDGES)
            stats.histogram = [int(c) for c in counts]
            stats.max_length = int(max(lengths))
        meta = {"tokenizer_fingerprint": encoder.tokenizer_fingerprint,
                "chat_template_fingerprint": encoder.chat_template_fingerprint, "source": self.uri}
        shard = encode_shard(self.ids, self.tokens, self.masks, meta)
        return FileResult(shard, shard_entry(shard_key, shard), self.errors, stats)


def sample_chars(sample: Sample) -> int:
    """About how many characters the sample renders as (its texts; the template adds a few)."""
    return sum(len(m.get("content") or "") + len(m.get("reasoning") or "") for m in sample.messages)


def errors_jsonl(errors: list[dict]) -> bytes:
    return b"".join(_error_line(e) for e in errors)


def _error_line(e: dict) -> bytes:
    try:
        return (json.dumps(e, ensure_ascii=False) + "\n").encode()
    except UnicodeEncodeError:  # a lone surrogate in an id: escaped, still one valid JSON line
        return (json.dumps(e) + "\n").encode()
