"""Reading prompt sets: files under a prefix (or one file) in the common public shapes.

Files (see :mod:`dfp_shared.record_sources` for the non-JSONL readers):

* JSON Lines (``.jsonl``, ``.ndjson``, ``.json``, optionally ``.gz``): one record per line;
* one JSON array of records (a ``.json``/``.json.gz`` file whose first character is ``[``, e.g.
  ShareGPT_V3), streamed record by record;
* Parquet files (``.parquet``): one record per row;
* ``datasets`` ``save_to_disk`` directories: the ``data-*.arrow`` files beside ``state.json``.

Accepted records (a JSON object, or a row with these columns):

* ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI / HF chat format);
* ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}`` (ShareGPT), or
  ``conversations`` with ``role``/``content``;
* ``{"prompt": "..."}`` (optionally with ``"system": "..."``);
* ``{"question_id": 81, "turns": ["first user turn", ...]}`` (MT-Bench): only the first turn is a
  prompt. Later turns are asked after the model's own answer to the earlier ones, so they are not
  static prompts and are not read.

Trailing assistant turns are dropped (the target regenerates them). A prompt's id is its ``id``
field when present (``question_id`` for MT-Bench records), else ``<file>:<line>`` (JSON Lines) or
``<file>#<index>`` (the 0-based record index of an array, or row of a Parquet/Arrow file). A record
that cannot be read becomes a :class:`PromptError` naming the file, its place and the reason; the
caller reports and skips it.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlparse

from dfp_shared.record_sources import (
    DEFAULT_MAX_RECORD_BYTES,
    LINES,
    RecordError,
    detect_format,
    iter_records,
    select_inputs,
    unit_of,
)
from dfp_shared.storage.store import NotFound, ObjectStore, StorageError, open_store, split_uri, visible

MAX_RECORD_BYTES = DEFAULT_MAX_RECORD_BYTES
"""A JSON-array record larger than this is one unreadable record (it is not built in memory)."""
PROMPT_SUFFIXES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz", ".parquet", ".arrow")
ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                "bot": "assistant", "chatgpt": "assistant", "system": "system", "tool": "tool", "function": "tool",
                "observation": "tool"}


class PromptFileError(StorageError):
    """A whole prompt file cannot be read (e.g. a corrupt gzip file)."""


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict]
    file: str
    line: int
    """The prompt's place in ``file``: a line number, record index or row, as ``unit`` says."""
    unit: str = "line"

    def place(self) -> dict:
        return {"file": self.file, self.unit: self.line}


@dataclass(frozen=True)
class PromptError:
    file: str
    line: int
    reason: str
    unit: str = "line"

    def to_record(self) -> dict:
        return {"file": self.file, self.unit: self.line, "error": self.reason, "kind": "unreadable_prompt"}


@dataclass(frozen=True)
class PromptSource:
    """Where a prompt set's files live: the store root URI and the file keys in it."""

    root: str
    keys: list[str]


def resolve_prompt_set(uri: str, endpoint_url: str | None = None) -> PromptSource:
    """The files of a prompt set: ``uri`` names one file, or a prefix holding prompt files."""
    parsed = urlparse(uri)
    path = parsed.path if parsed.scheme else uri
    if path.endswith(PROMPT_SUFFIXES):
        root, key = split_uri(uri)
        if "/" in key:  # the file's own folder as the root (an S3 key), so a task's root lies under the spec's
            folder, _, key = key.rpartition("/")
            root = f"{root}/{folder}"
        if not open_store(root, endpoint_url=endpoint_url).exists(key):
            raise NotFound(f"prompt file {uri} does not exist")
        return PromptSource(root, [key])
    try:
        store = open_store(uri, endpoint_url=endpoint_url)
        keys = select_inputs(visible(store.list("")), PROMPT_SUFFIXES)
    except (NotADirectoryError, FileExistsError):
        keys = []
    if not keys:
        raise NotFound(f"no prompt files ({', '.join(PROMPT_SUFFIXES)}) under {uri}")
    return PromptSource(store.uri, keys)


def _message(raw, where: str) -> dict:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object, got {type(raw).__name__}")
    role = raw.get("role", raw.get("from"))
    content = raw.get("content", raw.get("value"))
    if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
        raise ValueError(f"{where}.role: unknown role {role!r}")
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
        content = "".join(texts)
    if not isinstance(content, str):
        raise ValueError(f"{where}.content: expected a string, got {type(content).__name__}")
    return {"role": ROLE_ALIASES[role.lower()], "content": content}


def parse_prompt(obj, file: str, line: int, unit: str = "line") -> Prompt:
    """One prompt from a decoded record; raises ValueError naming the field that is wrong.

    The one rule of what a record means as a prompt, whatever file it came from.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    asked = None  # MT-Bench's question_id, the id of a record given as turns
    if "messages" in obj or "conversations" in obj:
        field = "messages" if "messages" in obj else "conversations"
        turns = obj[field]
        if not isinstance(turns, list):
            raise ValueError(f"{field}: expected a list of messages")
        messages = [_message(m, f"{field}[{i}]") for i, m in enumerate(turns)]
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError(f"prompt: expected a string, got {type(obj['prompt']).__name__}")
        messages = [{"role": "user", "content": obj["prompt"]}]
        if isinstance(obj.get("system"), str) and obj["system"]:
            messages.insert(0, {"role": "system", "content": obj["system"]})
    elif "turns" in obj:  # MT-Bench: later turns follow the model's own answers, so only the first is static
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise ValueError("turns: expected a list of strings (the user's turns)")
        messages = [{"role": "user", "content": turns[0]}]
        asked = obj.get("question_id")
    else:
        raise ValueError("no 'messages', 'conversations' or 'prompt' field (nor MT-Bench 'turns')")
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages or not any(m["role"] == "user" for m in messages):
        raise ValueError("no user message to answer")
    pid = obj.get("id", obj.get("uuid", asked))
    pid = str(pid) if pid not in (None, "") else (f"{file}:{line}" if unit == "line" else f"{file}#{line}")
    return Prompt(id=pid, messages=messages, file=file, line=line, unit=unit)


def parse_line(raw: bytes | str, file: str, line: int, where: str | None = None) -> Prompt | PromptError | None:
    """A prompt, an error naming file and line, or None for a blank line.

    ``file`` is the key the default id is derived from; ``where`` (default ``file``) names the
    file in error reports.
    """
    where = where or file
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return PromptError(where, line, f"not UTF-8: {exc.reason} at byte {exc.start}")
    if not raw.strip():
        return None
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return PromptError(where, line, f"invalid JSON: {exc.msg} at column {exc.colno}")
    try:
        return parse_prompt(obj, file, line)
    except ValueError as exc:
        return PromptError(where, line, str(exc))


def split_lines(data: bytes, key: str) -> list[bytes]:
    """The lines of a prompt file's bytes (gunzipped for ``.gz``), without line ends."""
    if key.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise PromptFileError(f"{key}: not a readable gzip file ({exc})") from None
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [line.rstrip(b"\r") for line in lines]


def read_lines(store: ObjectStore, key: str, start: int = 1, end: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(line number, raw bytes) of ``key`` from line ``start`` (1-based) to ``end`` (exclusive)."""
    lines = split_lines(store.get(key), store.url(key))
    stop = len(lines) if end is None else min(len(lines), end - 1)
    for index in range(max(0, start - 1), stop):
        yield index + 1, lines[index]


def parse_record(item, file: str, position: int, unit: str, where: str | None = None) -> Prompt | PromptError:
    """A prompt, or an error naming its place, from one item of a record reader."""
    where = where or file
    if isinstance(item, RecordError):
        return PromptError(where, position, item.reason, unit)
    try:
        return parse_prompt(item, file, position, unit)
    except ValueError as exc:
        return PromptError(where, position, str(exc), unit)


def iter_prompts(store: ObjectStore, key: str, start: int | None = None, end: int | None = None,
                 fmt: str | None = None, where: str | None = None) -> Iterator[Prompt | PromptError]:
    """Prompts and unreadable-record errors of one file's range of positions (blank lines skipped).

    ``fmt`` is the file's format (None: found from its name and first bytes); positions are 1-based
    lines of a JSON Lines file (``start`` defaults to 1), 0-based records or rows otherwise.
    ``where`` (default the key's URL) names the file in errors.
    """
    where = where or store.url(key)
    fmt = fmt or detect_format(store, key)
    if fmt == LINES:
        for number, raw in read_lines(store, key, 1 if start is None else start, end):
            item = parse_line(raw, key, number, where)
            if item is not None:
                yield item
        return
    unit = unit_of(fmt)
    for position, item in iter_records(store, key, fmt, start or 0, end, max_record_bytes=MAX_RECORD_BYTES):
        yield parse_record(item, key, position, unit, where)


def read_prompt_set(uri: str, endpoint_url: str | None = None, limit: int | None = None
                    ) -> tuple[list[Prompt], list[PromptError]]:
    """The prompts (the first ``limit``; None: all) and unreadable lines of a prompt set, in file order."""
    source = resolve_prompt_set(uri, endpoint_url)
    store = open_store(source.root, endpoint_url=endpoint_url)
    prompts, errors = [], []
    for key in source.keys:
        for item in iter_prompts(store, key):
            if isinstance(item, PromptError):
                errors.append(item)
            elif limit is None or len(prompts) < limit:
                prompts.append(item)
    return prompts, errors
