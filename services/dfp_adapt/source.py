"""Captured traffic as training data: the records of a time window, split for training and evaluation.

The capture pass-through writes completion records under its prefix in hourly folders,
``completions/<YYYYMMDDTHH>/<shard>.jsonl`` (UTC), each record's ``meta`` holding ``captured_at``,
``greedy`` (sampled at temperature 0 or top-k 1) and ``incomplete`` (the client left mid-stream).
:func:`prepare_source` reads the hours of a window and writes, under an output prefix:

* ``data/captured-<n>.jsonl`` - the records to train on as they are: the greedy ones (the target's own
  greedy answers, what the drafter will be asked to predict), and the others too when they are not
  regenerated;
* ``regenerate/prompts-<n>.jsonl`` - the prompts of the sampled records, for a generate job to answer
  greedily (only with ``regenerate``);
* ``heldout/prompts.jsonl`` - the newest ``heldout_share`` of the records, as prompts no training sees:
  the slice both drafters are evaluated on.

Incomplete records, lines that are not completion records and lines over :data:`MAX_LINE_BYTES` are dropped
and counted. Two passes over the window's shards (an index of times first, then the records), each a stream of
lines, and the split's files cut at :data:`MAX_FILE_BYTES`, so memory holds the index and about one record, not
the text of a shard or of a file.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone

from dfp_shared.records.capture_layout import CAPTURED_AT_FORMAT, HOUR_FORMAT, SHARDS
from dfp_shared.records.completions import MESSAGES, META, encode_records, record_id
from dfp_shared.storage.store import ObjectStore, open_store, visible

MAX_WINDOW_HOURS = 24 * 31
MAX_HELDOUT_SHARE = 0.5
MAX_HELDOUT = 10_000  # an evaluate job reads at most this many prompts of a set
MAX_RECORDS = 1_000_000
MAX_LINE_BYTES = 16 << 20
RECORDS_PER_FILE = 4096
MAX_FILE_BYTES = 64 << 20  # a file of the split is cut past this many bytes (or RECORDS_PER_FILE records)


class SourceError(ValueError):
    """A window or a capture prefix that gives nothing to train on (the message says why)."""


@dataclass
class SourceSplit:
    """What :func:`prepare_source` wrote, and what it dropped."""

    data: str  # prefix of the records trained on as they are
    regenerate: str | None  # prefix of the prompts to regenerate; None: nothing to regenerate
    heldout: str  # the held-out prompt set (one JSONL file)
    shards: int = 0
    greedy: int = 0
    sampled: int = 0
    heldout_records: int = 0
    dropped: dict = field(default_factory=lambda: {"incomplete": 0, "unreadable": 0, "long_line": 0})

    def as_dict(self) -> dict:
        return asdict(self)


def window(since: datetime | None, until: datetime | None, hours: float | None,
           now: datetime | None = None) -> tuple[datetime, datetime]:
    """The window ``[since, until)`` in UTC: given both, or the ``hours`` ending at ``until`` (default now)."""
    until = _utc(until) if until is not None else (now or datetime.now(timezone.utc))
    if since is None:
        if hours is None or not 0 < hours <= MAX_WINDOW_HOURS:
            raise SourceError(f"window: give since, or hours in (0, {MAX_WINDOW_HOURS}]")
        since = until - timedelta(hours=hours)
    since = _utc(since)
    if since >= until:
        raise SourceError(f"window: since {since:%Y-%m-%dT%H:%M}Z is not before until {until:%Y-%m-%dT%H:%M}Z")
    if until - since > timedelta(hours=MAX_WINDOW_HOURS):
        raise SourceError(f"window: longer than {MAX_WINDOW_HOURS} hours")
    return since, until


def _utc(moment: datetime) -> datetime:
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


def window_hours(since: datetime, until: datetime) -> list[str]:
    """The hour folders that hold records captured in ``[since, until)``."""
    hour = since.replace(minute=0, second=0, microsecond=0)
    out = []
    while hour < until:
        out.append(hour.strftime(HOUR_FORMAT))
        hour += timedelta(hours=1)
    return out


def _captured_at(record: dict) -> datetime | None:
    try:
        return _utc(datetime.strptime(str(record[META]["captured_at"]), CAPTURED_AT_FORMAT))
    except (KeyError, TypeError, ValueError):
        return None


def _usable(line: bytes | None, dropped: dict) -> dict | None:
    """A complete completion record whose last message is the assistant's answer, else None (counted); a line
    over :data:`MAX_LINE_BYTES` comes as None."""
    if line is None:
        dropped["long_line"] += 1
        return None
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    messages = record.get(MESSAGES) if isinstance(record, dict) else None
    if not isinstance(messages, list) or len(messages) < 2 or not all(isinstance(m, dict) for m in messages) \
            or messages[-1].get("role") != "assistant" or not isinstance(record.get(META), dict):
        dropped["unreadable"] += 1
        return None
    if record[META].get("incomplete"):
        dropped["incomplete"] += 1
        return None
    return record


def _lines(store: ObjectStore, key: str) -> Iterator[bytes | None]:
    """The shard's non-empty lines as a stream; a line over :data:`MAX_LINE_BYTES` comes as None, its bytes
    skipped in bounded pieces rather than held."""
    with store.open_read(key) as f:
        while line := f.readline(MAX_LINE_BYTES + 1):
            if len(line) > MAX_LINE_BYTES:
                while line and not line.endswith(b"\n"):
                    line = f.readline(MAX_LINE_BYTES)
                yield None
            elif line.strip():
                yield line


def _index(store: ObjectStore, keys: list[str], since: datetime, until: datetime, split: SourceSplit) -> list[tuple]:
    """``(captured_at, id, key, line)`` of every usable record captured inside the window."""
    index = []
    for key in keys:
        for n, line in enumerate(_lines(store, key)):
            record = _usable(line, split.dropped)
            if record is None:
                continue
            at = _captured_at(record)
            if at is None:  # no capture time: not the pass-through's record
                split.dropped["unreadable"] += 1
                continue
            if not since <= at < until:  # an hour folder holds its whole hour; the window may cut it
                continue
            index.append((at, record_id(record, f"{key}:{n}"), key, n))
            if len(index) > MAX_RECORDS:
                raise SourceError(f"window: more than {MAX_RECORDS} records; choose a shorter window")
    return index


def _prompt(record: dict, rid: str) -> dict:
    return {"id": rid, MESSAGES: record[MESSAGES][:-1]}


class _Files:
    """Records written as JSONL files of at most ``RECORDS_PER_FILE`` lines under ``prefix``."""

    def __init__(self, store: ObjectStore, prefix: str):
        self.store, self.prefix, self.rows, self.bytes, self.files = store, prefix, [], 0, 0

    def add(self, row: dict) -> None:
        line = encode_records([row])
        self.rows.append(line)
        self.bytes += len(line)
        if len(self.rows) >= RECORDS_PER_FILE or self.bytes >= MAX_FILE_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            self.store.put(f"{self.prefix}-{self.files:05d}.jsonl", b"".join(self.rows))
            self.files, self.rows, self.bytes = self.files + 1, [], 0


def prepare_source(capture: str, output: str, since: datetime, until: datetime, *, heldout_share: float,
                   regenerate: bool, endpoint_url: str | None = None) -> SourceSplit:
    """Read the window's records under ``capture`` and write the split under ``output`` (see the module)."""
    if not 0 < heldout_share <= MAX_HELDOUT_SHARE:
        raise SourceError(f"heldout_share {heldout_share}: expected (0, {MAX_HELDOUT_SHARE}]")
    src, out = open_store(capture, endpoint_url=endpoint_url), open_store(output, endpoint_url=endpoint_url)
    base = output.rstrip("/") + "/"
    split = SourceSplit(data=base + "data/", regenerate=base + "regenerate/" if regenerate else None,
                        heldout=base + "heldout/prompts.jsonl")
    keys = [k for hour in window_hours(since, until) for k in visible(src.list(f"{SHARDS}{hour}/"))
            if k.endswith(".jsonl")]
    split.shards = len(keys)
    index = _index(src, keys, since, until, split)
    held = min(MAX_HELDOUT, max(1, round(len(index) * heldout_share)))
    if len(index) <= held:
        raise SourceError(f"window {since:%Y-%m-%dT%H:%M}Z..{until:%Y-%m-%dT%H:%M}Z: {len(index)} usable records "
                          f"in {len(keys)} shards under {capture}; too few to hold out {held} and train on the rest")
    index.sort()
    heldout = {(key, n) for _, _, key, n in index[-held:]}
    data, prompts = _Files(out, "data/captured"), _Files(out, "regenerate/prompts")
    with tempfile.NamedTemporaryFile(prefix="dflash-heldout-", suffix=".jsonl") as held_file:
        _copy_split(src, index, heldout, regenerate, split, data, prompts, held_file)
        held_file.flush()
        out.put_file("heldout/prompts.jsonl", held_file.name)
    data.flush()
    prompts.flush()
    if prompts.files == 0:
        split.regenerate = None
    return split


def _copy_split(src: ObjectStore, index: list[tuple], heldout: set, regenerate: bool, split: SourceSplit,
                data: _Files, prompts: _Files, held_file) -> None:
    """The second pass: each indexed record to the data, the prompts to regenerate or the held-out file."""
    indexed = {(key, n): rid for _, rid, key, n in index}
    for key in dict.fromkeys(k for _, _, k, _ in index):
        # the second read keeps only the lines the index chose: a shard the capture appended to meanwhile adds
        # nothing, so the held-out share and the counts are of one set of records
        for n, line in enumerate(_lines(src, key)):
            if (key, n) not in indexed:
                continue
            record = _usable(line, {"incomplete": 0, "unreadable": 0, "long_line": 0})
            if record is None or record_id(record, f"{key}:{n}") != indexed[key, n]:
                continue
            rid = indexed[key, n]
            if (key, n) in heldout:
                held_file.write(encode_records([_prompt(record, rid)]))
                split.heldout_records += 1
            elif record[META].get("greedy") is True or not regenerate:
                split.greedy += record[META].get("greedy") is True
                split.sampled += record[META].get("greedy") is not True
                data.add(record)
            else:
                split.sampled += 1
                prompts.add(_prompt(record, rid))
