"""The served drafter's store: where serving reads a drafter, its version history, promotion and rollback.

Layout under ``<served>/<name>/`` (``served`` is the operator's served location, inside the storage roots):

* ``current.json`` - the pointer serving reads, the serving configuration: a drafter ``{"method": "dflash",
  "version": n, "drafter": "versions/<n>/"}`` (or ``dspark``, ``dflash2``), n-gram speculation ``{"method":
  "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}`` or no speculation
  ``{"method": "none"}`` (a pointer naming only a version is a ``dflash`` drafter's); one small file
  written whole (a rename on a local disk, one object put on S3), so a reader sees the old version or the new,
  never part of one (``dflash-pipeline adapt current`` resolves it);
* ``versions/<n>/`` - every drafter ever promoted, byte for byte as it was promoted, numbered from 1, complete
  before the pointer names it and never written again;
* ``history.json`` - the decisions in order (promoted, refused, rolled back: the evidence and the reason)
  and ``stack``, the configurations that have been current, the current one last (a drafter as its version
  number, n-gram or no speculation as its pointer's fields).

A promotion writes the new version first, then the pointer, then ``history.json``; a rollback points back at the
version before the current one and records it. A store promoted before the pointer existed holds a copy,
``current/``: until its next change its history's current version is the one served, and that change removes the
copy once the pointer is written. One change at a time: a promotion, rollback or recorded refusal holds
``lock.json`` (created only if absent) while it runs, so a scheduled run's promotion and an operator's rollback
never both move the pointer and rewrite the history from what each read first; the second is refused, naming the
first. A lock whose holder died is taken over after :data:`LOCK_TTL_S` (or at once when it is dated impossibly
or unreadable), by exactly one of those who find it (each creates a mark named after the stale lock's bytes, under
``locks/``, only if absent, and goes on only if the lock is still those bytes; a mark older than
:data:`MARK_TTL_S`, its maker dead midway, is stepped over to the next name); a change releases only its own lock
(a token in it), and clears the marks of locks that are gone. Whatever is read from these files reaches a message
without its control characters. Whether a candidate is promoted is :mod:`.promotion_rule`'s to say.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import secrets
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dfp_shared.printable import printable
from dfp_shared.storage.store import NotFound, ObjectStore, open_store, visible

from dfp_adapt.serving import DRAFTER_METHODS, MAX_BLOCK_SIZE, read_drafter_config

log = logging.getLogger(__name__)

HISTORY = "history.json"
POINTER = "current.json"
OLD_COPY = "current/"  # what serving read before the pointer: removed by a store's first change after it
VERSIONS = "versions/"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_HISTORY_BYTES = 16 << 20
MAX_POINTER_BYTES = 4096
MAX_VERSION = 10**9 - 1  # version folders of more digits are no version a promotion made
MAX_EVENTS = 10_000  # the oldest decisions are dropped past this many (the versions stay)
LOCK = "lock.json"
LOCKS = "locks/"  # the marks of locks taken over from dead holders
LOCK_TTL_S = 6 * 3600  # a change holding the lock longer than this is taken for dead (copies of a large drafter)
MARK_TTL_S = 600  # a takeover mark older than this was left by a change that died between making it and the lock
MAX_MARKS = 16  # dead takeovers of one stale lock stepped over before the store is refused, naming what to remove
CLOCK_SKEW_S = 300  # a lock dated further ahead than this is no live holder's


def _stale(since: float, ttl: float = LOCK_TTL_S) -> bool:
    """A lock (or mark) made at ``since`` is its dead holder's: older than ``ttl``, or dated impossibly (ahead of
    this clock by more than a skew, or not a finite time)."""
    now = time.time()
    return not math.isfinite(since) or since > now + CLOCK_SKEW_S or now - since >= ttl


def _text(value: object, limit: int) -> str:
    """A string read from the store, fit for a message: one line, no control characters, at most ``limit``."""
    return printable(str(value), keep_newlines=False)[:limit]


class PromotionError(ValueError):
    """A promotion or rollback that cannot be done (the message says why)."""


def check_name(name: str) -> str:
    """A drafter name: 1..64 letters, digits, ``.``, ``_`` or ``-``, starting with a letter or digit."""
    if not NAME_RE.match(name) or ".." in name:
        raise PromotionError(f"drafter name {name!r}: use 1..64 letters, digits, '.', '_' or '-'")
    return name


def _stacked(entry: object) -> bool:
    """A stack entry: a version number, or an n-gram or no-speculation configuration."""
    if type(entry) is int:
        return 0 < entry <= MAX_VERSION
    if not isinstance(entry, dict):
        return False
    if entry.get("method") == "none":
        return set(entry) == {"method"}
    sizes = [entry.get(k) for k in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")]
    return entry.get("method") == "ngram" and len(entry) == 4 and all(type(v) is int and 0 < v <= MAX_BLOCK_SIZE
                                                                     for v in sizes) and sizes[1] <= sizes[2]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True)
class Served:
    """The version serving reads and its drafter directory's URI (``<served>/<name>/versions/<n>/``)."""

    version: int
    uri: str


class ServedDrafters:
    """The served store of one drafter name (see the module's docstring for the layout)."""

    def __init__(self, served: str, name: str, endpoint_url: str | None = None):
        self.name = check_name(name)
        self.uri = served.rstrip("/") + "/" + name + "/"
        self.store = open_store(self.uri, endpoint_url=endpoint_url)
        self.endpoint_url = endpoint_url
        self._token: str | None = None  # the lock's token while this object holds it

    def version_uri(self, version: int) -> str:
        """A promoted version's own copy (it never changes; serving, warm starts and evaluations read it)."""
        return f"{self.uri}{VERSIONS}{version}/"

    def history(self) -> dict:
        """``{"name", "stack", "events"}``; empty for a name never promoted."""
        try:
            with self.store.open_read(HISTORY) as f:
                data = f.read(MAX_HISTORY_BYTES + 1)
        except NotFound:
            return {"name": self.name, "stack": [], "events": []}
        if len(data) > MAX_HISTORY_BYTES:
            raise PromotionError(f"{self.uri}{HISTORY}: larger than {MAX_HISTORY_BYTES} bytes")
        try:
            history = json.loads(data)
        except RecursionError:
            raise PromotionError(f"{self.uri}{HISTORY}: nested too deeply") from None
        except ValueError as exc:
            raise PromotionError(f"{self.uri}{HISTORY}: not JSON ({exc})") from None
        if not isinstance(history, dict) or not isinstance(history.get("stack"), list) \
                or not isinstance(history.get("events"), list) \
                or not all(_stacked(v) for v in history["stack"]):
            raise PromotionError(f"{self.uri}{HISTORY}: not a served drafter's history")
        return history

    def _pointer(self) -> dict | None:
        """The configuration ``current.json`` names; None without one (nothing served, or a store from before it)."""
        try:
            with self.store.open_read(POINTER) as f:
                data = f.read(MAX_POINTER_BYTES + 1)
        except NotFound:
            return None
        where = f"{self.uri}{POINTER}"
        if len(data) > MAX_POINTER_BYTES:
            raise PromotionError(f"{where}: larger than {MAX_POINTER_BYTES} bytes; not a pointer")
        try:
            pointer = json.loads(data)
            method = pointer.get("method", "dflash")
        except (ValueError, RecursionError, TypeError, AttributeError):
            raise PromotionError(f"{where}: not a pointer (a JSON object naming a configuration)") from None
        if method in ("ngram", "none"):
            config = {k: v for k, v in pointer.items() if k != "time"}
            if not _stacked(config):
                raise PromotionError(f"{where}: not a {method} configuration")
            return config
        version = pointer.get("version")
        if method not in DRAFTER_METHODS:
            raise PromotionError(f"{where}: method {_text(method, 32)} is no serving method")
        if type(version) is not int or not 0 < version <= MAX_VERSION:
            raise PromotionError(f"{where}: version {_text(version, 32)} is no version number")
        return {"method": method, "version": version}

    def configuration(self) -> dict | None:
        """The configuration served: the pointer's, or for a store from before the pointer its history's current one
        (a version there is a ``dflash`` drafter); None when nothing was ever served."""
        config = self._pointer()
        if config is None:
            stack = self.history()["stack"]
            if not stack:
                return None
            config = {"method": "dflash", "version": stack[-1]} if type(stack[-1]) is int else dict(stack[-1])
        return config

    def current_version(self) -> int | None:
        """The drafter version served; None when nothing, n-gram or no speculation is served."""
        config = self.configuration()
        return config.get("version") if config else None

    def latest_drafter(self) -> int | None:
        """The drafter version served, or else the last one that was (what a candidate is warm-started from)."""
        version = self.current_version()
        if version is None:
            versions = [v for v in self.history()["stack"] if type(v) is int]
            version = versions[-1] if versions else None
        return version

    def current(self) -> Served | None:
        """The version serving reads and its drafter directory (checked to hold a drafter); None if none."""
        version = self.current_version()
        if version is None:
            return None
        if not self.store.exists(f"{VERSIONS}{version}/config.json"):
            raise PromotionError(f"{self.uri}: the served version {version} holds no config.json (not a drafter)")
        return Served(version, self.version_uri(version))

    def _write_history(self, history: dict) -> None:
        """Written with the oldest events dropped past :data:`MAX_EVENTS` or half of :data:`MAX_HISTORY_BYTES` (the
        stack and the versions stay), so the history is always one the next run can read."""
        history["events"] = history["events"][-MAX_EVENTS:]
        data = json.dumps(history, indent=1) + "\n"
        while len(data) > MAX_HISTORY_BYTES // 2 and history["events"]:
            history["events"] = history["events"][len(history["events"]) // 4 + 1:]
            data = json.dumps(history, indent=1) + "\n"
        self.store.put(HISTORY, data.encode())

    def _versions(self) -> list[int]:
        """The version folders' numbers; a folder that is no ASCII number (``²`` is a digit to ``str.isdigit``)
        is skipped with a warning."""
        found, skipped = set(), set()
        for key in self.store.list(VERSIONS):
            head = key[len(VERSIONS):].split("/", 1)[0]
            if len(head) <= len(str(MAX_VERSION)) and head.isascii() and head.isdigit() and int(head) > 0:
                found.add(int(head))
            elif head not in skipped:
                skipped.add(head)
                log.warning("a folder under versions/ that is no version number is skipped",
                            extra={"store": self.uri, "folder": ascii(head)[:80]})
        return sorted(found)

    @contextmanager
    def _changing(self, action: str) -> Iterator[None]:
        """Hold the store's lock while ``action`` changes it (see the module's docstring)."""
        token = secrets.token_hex(16)
        mine = json.dumps({"action": action, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
                           "token": token}).encode()
        mark = self._take_lock(mine)
        self._clear_marks(mark, mine)
        self._token = token
        try:
            yield
        finally:
            self._token = None
            if self._lock_holder()[0]["token"] == token:  # a change that outlived the TTL and was taken over leaves it be
                self.store.delete(LOCK)
            if mark is not None:
                self.store.delete(mark)

    def _take_lock(self, mine: bytes) -> str | None:
        """Create the lock holding ``mine``, or take over a stale one (returns its takeover mark); raises
        PromotionError naming what holds the store otherwise."""
        for _ in range(3):
            if self.store.put_if_absent(LOCK, mine):
                return None
            held, raw = self._lock_holder()
            if raw:
                break
            # no lock to read: released meanwhile (so try again), or a lock.json that is no file at all
        else:
            raise PromotionError(
                f"{self.store.url(LOCK)} is no lock (a folder, or nothing a store can read as a file) and holds every "
                f"change off while it is there: remove it (no change of this store can be holding it)")
        if not _stale(held["since"]):
            raise PromotionError(
                f"{self.uri}: a {held['action']} by {held['host']} (pid {held['pid']}) is in progress since "
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(held['since']))}; try again when it ends "
                f"(a lock older than {LOCK_TTL_S} s is taken over)")
        # its holder died: of all who found this same stale lock, the one that creates its takeover mark and finds
        # the lock unchanged after replaces it (a delete then a create alone let two hold it)
        mark = self._mark(raw, mine)
        if not self._still(raw):
            self.store.delete(mark)
            raise PromotionError(f"{self.uri}: another change took over the lock; try again")
        self.store.delete(LOCK)
        if not self.store.put_if_absent(LOCK, mine):
            self.store.delete(mark)
            raise PromotionError(f"{self.uri}: another change took the lock first; try again")
        return mark

    def _mark(self, raw: bytes, mine: bytes) -> str:
        """Create the takeover mark of the stale lock ``raw``: its first name no one holds, past the marks of
        takeovers that died midway (older than :data:`MARK_TTL_S`); refused while a live one holds a name."""
        base = f"{LOCKS}takeover-{hashlib.sha256(raw).hexdigest()[:32]}"
        for n in range(MAX_MARKS):
            mark = f"{base}-{n}.json" if n else f"{base}.json"
            if self.store.put_if_absent(mark, mine):
                return mark
            if not self._mark_dead(mark):
                raise PromotionError(f"{self.uri}: another change is taking over a stale lock; try again (a takeover "
                                     f"mark older than {MARK_TTL_S} s is stepped over)")
        raise PromotionError(f"{self.uri}: {MAX_MARKS} takeovers of a stale lock died midway; remove {LOCK} and "
                             f"{LOCKS} (no change of this store can be holding them)")

    def _mark_dead(self, mark: str) -> bool:
        """Whether a takeover mark was left by a change that died making it (old, dated impossibly, unreadable)."""
        try:
            with self.store.open_read(mark) as f:
                return _stale(float(json.loads(f.read(4096))["since"]), MARK_TTL_S)
        except NotFound:
            return False  # its takeover ended meanwhile: whether it took the lock, the next try tells
        except (ValueError, TypeError, KeyError, RecursionError, OverflowError):
            return True  # no change writes such a mark

    def _clear_marks(self, mine_mark: str | None, mine: bytes) -> None:
        """With the lock held: remove the marks of locks that are gone (no one can take those over any more), keeping
        this change's own mark and any of its own lock's."""
        own = f"{LOCKS}takeover-{hashlib.sha256(mine).hexdigest()[:32]}"
        for key in list(self.store.list(LOCKS)):
            if key != mine_mark and not key.startswith(own):
                self.store.delete(key)

    def _lock_holder(self) -> tuple[dict, bytes]:
        """The lock's holder (its fields fit for a message) and its bytes; an unreadable one counts as the oldest (it
        is taken over)."""
        raw = b""
        try:
            with self.store.open_read(LOCK) as f:
                raw = f.read(4096)
            held = json.loads(raw)
            return {"action": _text(held.get("action"), 32), "host": _text(held.get("host"), 253),
                    "pid": _text(held.get("pid"), 16), "since": float(held["since"]), "token": held.get("token")}, raw
        except (NotFound, ValueError, TypeError, KeyError, AttributeError, RecursionError,
                OverflowError):  # released meanwhile, or unreadable (a date past any float among them)
            return {"action": "change", "host": "?", "pid": "?", "since": 0.0, "token": None}, raw

    def _still(self, raw: bytes) -> bool:
        """Whether the lock still holds exactly ``raw`` (b"": none)."""
        return self._lock_holder()[1] == raw

    def record(self, event: dict) -> dict:
        """Add a decision that changes nothing served (a refusal) to the history; returns the event."""
        with self._changing("refusal"):
            return self._record(event)

    def record_failure(self, stage: str, reason: str, job_ids: list[str], **more) -> dict:
        """Add a run that failed at ``stage`` to the history (its reason without control characters)."""
        with self._changing("failure"):
            return self._record({"action": "failed", "stage": stage, "reason": printable(reason)[:4096],
                                 "job_ids": list(job_ids), **more})

    def serve(self, config: dict, evidence: dict) -> dict:
        """Point serving at n-gram speculation or at no speculation (``config``); returns the event."""
        if not _stacked(config) or type(config) is int:
            raise PromotionError(f"{self.uri}: {_text(config, 200)} is no n-gram or no-speculation configuration")
        with self._changing("promotion"):
            history = self.history()
            self._point_at(config)
            event = {"time": _now(), "action": "promoted", "configuration": config, **evidence}
            history["stack"].append(config)
            history["events"].append(event)
            self._write_history(history)
            return event

    def _record(self, event: dict) -> dict:
        history = self.history()
        event = {"time": _now(), **event}
        history["events"].append(event)
        self._write_history(history)
        return event

    def promote(self, candidate: str, evidence: dict) -> dict:
        """Copy the drafter export at ``candidate`` into a new version and point serving at it; returns the event."""
        with self._changing("promotion"):
            return self._promote(candidate, evidence)

    def _promote(self, candidate: str, evidence: dict) -> dict:
        source = open_store(candidate, endpoint_url=self.endpoint_url)
        files = sorted(visible(source.list("")))
        if "config.json" not in files:
            raise PromotionError(f"{candidate}: no config.json (not a drafter export)")
        history = self.history()
        version = max([0, *self._versions(), *(v for v in history["stack"] if type(v) is int)]) + 1
        prefix = f"{VERSIONS}{version}/"
        with tempfile.TemporaryDirectory(prefix="dflash-promote-") as tmp:
            _copy(source, "", self.store, prefix, files, Path(tmp))
        if sorted(k[len(prefix):] for k in visible(self.store.list(prefix))) != files:
            raise PromotionError(f"{self.store.url(prefix)}: the version does not hold the candidate's files; "
                                 f"nothing served changed")
        self._point_at(version)
        event = {"time": _now(), "action": "promoted", "version": version, "candidate": candidate,
                 "configuration": self._pointer(), **evidence}
        history["stack"].append(version)
        history["events"].append(event)
        self._write_history(history)
        return event

    def rollback(self, reason: str = "") -> dict:
        """Point serving back at the version that was current before the current one; returns the event."""
        with self._changing("rollback"):
            return self._rollback(reason)

    def _rollback(self, reason: str) -> dict:
        history = self.history()
        if len(history["stack"]) < 2:
            raise PromotionError(f"{self.uri}: no earlier version to roll back to "
                                 f"(versions current so far: {history['stack'] or 'none'})")
        undone, restored = history["stack"][-1], history["stack"][-2]
        if type(restored) is int and not self.store.exists(f"{VERSIONS}{restored}/config.json"):
            raise PromotionError(f"{self.version_uri(restored)}: version {restored} holds no config.json; "
                                 f"nothing served changed")
        self._point_at(restored)
        event = {"time": _now(), "action": "rolled_back", "version": restored, "undone": undone,
                 "configuration": self._pointer(),
                 **({"reason": reason} if reason else {})}
        history["stack"].pop()
        history["events"].append(event)
        self._write_history(history)
        return event

    def _point_at(self, target: int | dict) -> None:
        """Write the pointer (one small file, whole), while this change still holds the lock; then remove the copy
        serving read before the pointer existed."""
        if self._token is None or self._lock_holder()[0]["token"] != self._token:
            raise PromotionError(f"{self.uri}: this change ran past {LOCK_TTL_S} s and its lock was taken over; "
                                 f"nothing served changed")
        if type(target) is int:
            try:
                method = read_drafter_config(self.store, f"{VERSIONS}{target}/config.json")["method"]
            except (ValueError, NotFound) as exc:  # serving's own reading of it refuses it, naming why
                log.warning("a promoted drafter's config is unreadable; named as dflash", extra={"error": _text(exc, 300)})
                method = "dflash"
            pointer = {"method": method, "version": target, "drafter": f"{VERSIONS}{target}/", "time": _now()}
        else:
            pointer = {**target, "time": _now()}
        self.store.put(POINTER, (json.dumps(pointer) + "\n").encode())
        for key in list(self.store.list(OLD_COPY)):
            self.store.delete(key)


def _copy(src: ObjectStore, src_prefix: str, dst: ObjectStore, dst_prefix: str, files: list[str], tmp: Path) -> None:
    """Copy ``files`` (relative keys) through a local file each, so a large weights file is never held in memory."""
    for rel in files:
        local = tmp / "f"
        src.get_file(src_prefix + rel, local)
        dst.put_file(dst_prefix + rel, local)
        local.unlink()
