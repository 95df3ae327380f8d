"""Splitting a prompt set into shard tasks.

Every record of every prompt file belongs to exactly one shard, given as ranges of positions
(``segments``) so a task carries no prompt text: line ranges of JSON Lines files, record index
ranges of JSON arrays, row ranges of Parquet/Arrow files (whose reader opens only the row groups or
batches it covers; an array's reader parses past the records before its start without building
them). A shard holds ``shard_size`` readable prompts; unreadable records stay inside the range of
the shard that covers them, and that shard reports them.

The planner reads every file once, streamed (a big array or Parquet file is never held whole);
JSON Lines files are downloaded a window at a time, as they always were.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from dfp_shared.record_sources import LINES, detect_format
from dfp_shared.records.prompts import (
    Prompt,
    PromptSource,
    iter_prompts,
    parse_line,
    resolve_prompt_set,
    split_lines,
)
from dfp_shared.storage.store import open_store


@dataclass
class ShardPlan:
    index: int
    segments: list[dict] = field(default_factory=list)
    """``{"file": key, "start": first line, "end": line after the last}`` (1-based) of a JSON Lines file;
    other files' segments add ``"format"`` (see :mod:`dfp_shared.record_sources`) and count 0-based
    records or rows."""
    prompts: int = 0
    bad_lines: int = 0

    @property
    def key(self) -> str:
        return shard_key(self.index)

    def to_payload(self) -> dict:
        return asdict(self)

    @classmethod
    def from_payload(cls, payload: dict) -> ShardPlan:
        return cls(index=int(payload["index"]), segments=list(payload["segments"]), prompts=int(payload["prompts"]),
                   bad_lines=int(payload.get("bad_lines", 0)))


@dataclass
class Plan:
    source: PromptSource
    shards: list[ShardPlan]
    prompts: int
    bad_lines: int

    def to_dict(self) -> dict:
        return {"prompts_root": self.source.root, "files": self.source.keys, "prompts": self.prompts,
                "bad_lines": self.bad_lines, "shards": [s.to_payload() for s in self.shards]}


def shard_key(index: int) -> str:
    return f"shard-{index:05d}"


def _fetch(store, keys: list[str], window: int = 32):
    """(key, bytes) in order, downloading ``window`` files at a time (bounded memory)."""
    for start in range(0, len(keys), window):
        yield from store.get_many(keys[start:start + window])


def _formats(store, keys: list[str]) -> list[str]:
    """Each file's format (a ``.json`` file's first bytes are read to tell an array from JSON Lines)."""
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(keys)))) as pool:
        return list(pool.map(lambda k: detect_format(store, k), keys))


def _files(store, keys: list[str]):
    """(key, format, items) in order, ``items`` yielding (position, Prompt | PromptError | None)."""
    formats = _formats(store, keys)
    pending: list[str] = []  # JSON Lines files, fetched together

    def lines_files():
        for key, data in _fetch(store, pending):
            lines = split_lines(data, store.url(key))
            yield key, LINES, ((n, parse_line(raw, key, n)) for n, raw in enumerate(lines, start=1))
        pending.clear()

    for key, fmt in zip(keys, formats):
        if fmt == LINES:
            pending.append(key)
            continue
        yield from lines_files()
        yield key, fmt, ((item.line, item) for item in iter_prompts(store, key, fmt=fmt, where=key))
    yield from lines_files()


def _segment(key: str, fmt: str, start: int, end: int) -> dict:
    seg = {"file": key, "start": start, "end": end}
    if fmt != LINES:
        seg["format"] = fmt
    return seg


def plan_shards(prompts_uri: str, shard_size: int, endpoint_url: str | None = None) -> Plan:
    source = resolve_prompt_set(prompts_uri, endpoint_url=endpoint_url)
    store = open_store(source.root, endpoint_url=endpoint_url)
    shards: list[ShardPlan] = []
    cur = ShardPlan(0)
    seen: set[str] = set()  # prompt ids in the current shard (a repeat is reported, as the shard does)
    total_prompts = total_bad = 0
    for key, fmt, items in _files(store, source.keys):
        first = 1 if fmt == LINES else 0
        seg_start, seg_lines, last = first, 0, first - 1  # seg_lines: records (non-blank lines) in the open segment
        for number, item in items:
            last = number
            if item is None:
                continue
            seg_lines += 1
            if not isinstance(item, Prompt) or item.id in seen:
                cur.bad_lines += 1
                total_bad += 1
                continue
            seen.add(item.id)
            cur.prompts += 1
            total_prompts += 1
            if cur.prompts == shard_size:
                cur.segments.append(_segment(key, fmt, seg_start, number + 1))
                shards.append(cur)
                cur, seg_lines, seg_start = ShardPlan(len(shards)), 0, number + 1
                seen = set()
        if seg_lines:
            cur.segments.append(_segment(key, fmt, seg_start, last + 1))
    if cur.segments and shards and not cur.prompts:  # only unreadable lines left: the last shard reports them
        shards[-1].segments += cur.segments
        shards[-1].bad_lines += cur.bad_lines
    elif cur.segments or not shards:
        shards.append(cur)
    return Plan(source=source, shards=shards, prompts=total_prompts, bad_lines=total_bad)
