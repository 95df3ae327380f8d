"""Splitting a prompt set into shard tasks.

Every line of every prompt file belongs to exactly one shard, given as line ranges
(``segments``) so a task carries no prompt text. A shard holds ``shard_size`` readable prompts;
unreadable lines stay inside the range of the shard that covers them, and that shard reports them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dfp_shared.prompts import Prompt, PromptSource, parse_line, resolve_prompt_set, split_lines
from dfp_shared.storage import open_store


@dataclass
class ShardPlan:
    index: int
    segments: list[dict] = field(default_factory=list)
    """``{"file": key, "start": first line, "end": line after the last}`` (1-based)."""
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


def plan_shards(prompts_uri: str, shard_size: int, endpoint_url: str | None = None) -> Plan:
    source = resolve_prompt_set(prompts_uri, endpoint_url=endpoint_url)
    store = open_store(source.root, endpoint_url=endpoint_url)
    shards: list[ShardPlan] = []
    cur = ShardPlan(0)
    seen: set[str] = set()  # prompt ids in the current shard (a repeat is reported, as the shard does)
    total_prompts = total_bad = 0
    for key, data in _fetch(store, source.keys):
        lines = split_lines(data, store.url(key))
        seg_start, seg_lines = 1, 0  # seg_lines: non-blank lines in the open segment
        for number, raw in enumerate(lines, start=1):
            item = parse_line(raw, key, number)
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
                cur.segments.append({"file": key, "start": seg_start, "end": number + 1})
                shards.append(cur)
                cur, seg_lines, seg_start = ShardPlan(len(shards)), 0, number + 1
                seen = set()
        if seg_lines:
            cur.segments.append({"file": key, "start": seg_start, "end": len(lines) + 1})
    if cur.segments and shards and not cur.prompts:  # only unreadable lines left: the last shard reports them
        shards[-1].segments += cur.segments
        shards[-1].bad_lines += cur.bad_lines
    elif cur.segments or not shards:
        shards.append(cur)
    return Plan(source=source, shards=shards, prompts=total_prompts, bad_lines=total_bad)
