"""The completion record (generation's output, the tokenizer's input) and the completions manifest.

A record is one JSON object per line of ``completions/<shard>.jsonl``: ``id``, ``messages`` (the
prompt's chat messages, then the generated assistant turn with its thinking in
``reasoning_content``) and ``meta`` (model, sampling, finish reason, token counts, source).
``manifest.json`` under the output prefix lists the shard files with their counts, and the totals.
"""

from __future__ import annotations

import json

from dfp_shared.storage.store import ObjectStore

FORMAT = "dflash-completions/1"
MANIFEST = "manifest.json"
ID, MESSAGES, META = "id", "messages", "meta"
REASONING = "reasoning_content"
# the public shapes' names for the message list, after ours
MESSAGES_FIELDS = (MESSAGES, "conversations", "conversation")
SHARD_COUNTS = ("prompts", "completions", "errors", "unreadable", "truncated", "output_tokens")


class ManifestError(ValueError):
    """A completions manifest that is not one (the message names it)."""


def records_key(shard: str) -> str:
    return f"completions/{shard}.jsonl"


def errors_key(shard: str) -> str:
    return f"errors/{shard}.jsonl"


def completion_record(record_id: str, prompt_messages: list[dict], content: str, reasoning: str | None,
                      meta: dict) -> dict:
    """A record: the prompt's messages and the generated answer (``reasoning_content`` only when the
    model produced reasoning)."""
    answer = {"role": "assistant", "content": content}
    if reasoning is not None:
        answer[REASONING] = reasoning
    return {ID: record_id, MESSAGES: [*prompt_messages, answer], META: meta}


def encode_records(records: list[dict]) -> bytes:
    """Records (or any JSON objects) as JSONL: UTF-8, one object a line."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def record_id(record: dict, default: str) -> str:
    """A record's ``id`` as a string, or ``default`` when it has none (or an empty one)."""
    rid = record.get(ID)
    return str(rid) if rid is not None and rid != "" else default


def record_messages(record: dict):
    """A record's message list as written (not checked), under the first name of ``MESSAGES_FIELDS``
    it has; None when it has none."""
    for name in MESSAGES_FIELDS:
        if name in record:
            return record[name]
    return None


def shard_entry(shard: str, counts: dict) -> dict:
    """The manifest entry of one shard from its counts; ``errors_key`` when it has an errors file."""
    entry = {"key": records_key(shard), **{k: counts[k] for k in SHARD_COUNTS}}
    if counts["errors"] or counts["unreadable"]:
        entry["errors_key"] = errors_key(shard)
    return entry


def build_manifest(spec: dict, shards: list[dict], *, job_id: str | None = None) -> dict:
    """The manifest of a finished run: its spec, the totals of ``SHARD_COUNTS`` and the shard entries."""
    totals = {k: sum(s[k] for s in shards) for k in SHARD_COUNTS}
    return {"format": FORMAT, **({"job_id": job_id} if job_id else {}), "spec": spec, **totals, "shards": shards}


def write_manifest(store: ObjectStore, manifest: dict) -> None:
    store.put(MANIFEST, json.dumps(manifest, indent=1).encode())


def read_manifest(store: ObjectStore) -> dict:
    """The manifest under ``store`` (raises :class:`~dfp_shared.storage.store.NotFound` without one)."""
    try:
        manifest = json.loads(store.get(MANIFEST))
    except ValueError:
        raise ManifestError(f"{store.url(MANIFEST)}: not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise ManifestError(f"{store.url(MANIFEST)}: format {got!r}, expected {FORMAT!r}")
    return manifest
