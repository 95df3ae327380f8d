"""The served drafter's store: where serving reads a drafter, its version history, promotion and rollback.

Layout under ``<served>/<name>/`` (``served`` is the operator's served location, inside the storage roots):

* ``current/`` - the drafter serving reads (a drafter export: ``config.json``, ``model.safetensors``, ...);
* ``versions/<n>/`` - every drafter ever promoted, byte for byte as it was promoted, numbered from 1;
* ``history.json`` - the decisions in order (promoted, refused, rolled back: the evidence and the reason)
  and ``stack``, the versions that have been current, the current one last.

A promotion writes the new version first, then ``current/``, then ``history.json``; a rollback copies the
version before the current one back into ``current/`` (removing files the newer version added) and records
it. So a reader of ``history.json`` never sees a version that is not whole, on a local disk and on S3 alike.
One change at a time: a promotion, rollback or recorded refusal holds ``lock.json`` (created only if absent)
while it runs, so a scheduled run's promotion and an operator's rollback never both rewrite ``current/`` and the
history from what each read first; the second is refused, naming the first. A lock whose holder died is taken
over after :data:`LOCK_TTL_S` (or at once when it is dated impossibly), by exactly one of those who find it
(each creates a mark named after the stale lock's bytes, under ``locks/``, only if absent, and goes on only if
the lock is still those bytes); a change releases only its own lock (a token in it), and its mark.
Whether a candidate is promoted is :mod:`.promotion_rule`'s to say.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .storage import NotFound, ObjectStore, open_store, visible

HISTORY = "history.json"
CURRENT = "current/"
VERSIONS = "versions/"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_HISTORY_BYTES = 16 << 20
MAX_EVENTS = 10_000  # the oldest decisions are dropped past this many (the versions stay)
LOCK = "lock.json"
LOCKS = "locks/"  # the marks of locks taken over from dead holders
LOCK_TTL_S = 6 * 3600  # a change holding the lock longer than this is taken for dead (copies of a large drafter)
CLOCK_SKEW_S = 300  # a lock dated further ahead than this is no live holder's


def _stale(since: float) -> bool:
    """A lock taken at ``since`` is its dead holder's: older than the TTL, or dated impossibly (ahead of this
    clock by more than a skew, or not a finite time)."""
    now = time.time()
    return not math.isfinite(since) or since > now + CLOCK_SKEW_S or now - since >= LOCK_TTL_S


class PromotionError(ValueError):
    """A promotion or rollback that cannot be done (the message says why)."""


def check_name(name: str) -> str:
    """A drafter name: 1..64 letters, digits, ``.``, ``_`` or ``-``, starting with a letter or digit."""
    if not NAME_RE.match(name) or ".." in name:
        raise PromotionError(f"drafter name {name!r}: use 1..64 letters, digits, '.', '_' or '-'")
    return name


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class ServedDrafters:
    """The served store of one drafter name (see the module's docstring for the layout)."""

    def __init__(self, served: str, name: str, endpoint_url: str | None = None):
        self.name = check_name(name)
        self.uri = served.rstrip("/") + "/" + name + "/"
        self.store = open_store(self.uri, endpoint_url=endpoint_url)
        self.endpoint_url = endpoint_url

    @property
    def current_uri(self) -> str:
        """What serving reads (and a warm start starts from)."""
        return self.uri + CURRENT

    def version_uri(self, version: int) -> str:
        """A promoted version's own copy (it never changes; evaluations name it rather than ``current/``)."""
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
                or not all(type(v) is int and v > 0 for v in history["stack"]):
            raise PromotionError(f"{self.uri}{HISTORY}: not a served drafter's history")
        return history

    def current_version(self) -> int | None:
        stack = self.history()["stack"]
        return stack[-1] if stack else None

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
        found = set()
        for key in self.store.list(VERSIONS):
            head = key[len(VERSIONS):].split("/", 1)[0]
            if head.isdigit():
                found.add(int(head))
        return sorted(found)

    @contextmanager
    def _changing(self, action: str) -> Iterator[None]:
        """Hold the store's lock while ``action`` changes it (see the module's docstring)."""
        token = secrets.token_hex(16)
        mine = json.dumps({"action": action, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
                           "token": token}).encode()
        mark = None
        if not self.store.put_if_absent(LOCK, mine):
            held, raw = self._lock_holder()
            if raw and not _stale(held["since"]):
                raise PromotionError(
                    f"{self.uri}: a {held['action']} by {held['host']} (pid {held['pid']}) is in progress since "
                    f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(held['since']))}; try again when it ends "
                    f"(a lock older than {LOCK_TTL_S} s is taken over)")
            if raw:
                # its holder died: of all who found this same stale lock, the one that creates its takeover mark
                # and finds the lock unchanged after replaces it (a delete then a create alone let two hold it)
                mark = f"{LOCKS}takeover-{hashlib.sha256(raw).hexdigest()[:32]}.json"
                if not self.store.put_if_absent(mark, mine):
                    raise PromotionError(f"{self.uri}: another change is taking over a stale lock; try again")
                if not self._still(raw):
                    self.store.delete(mark)
                    raise PromotionError(f"{self.uri}: another change took over the lock; try again")
                self.store.delete(LOCK)
            if not self.store.put_if_absent(LOCK, mine):
                raise PromotionError(f"{self.uri}: another change took the lock first; try again")
        try:
            yield
        finally:
            if self._lock_holder()[0]["token"] == token:  # a change that outlived the TTL and was taken over leaves it be
                self.store.delete(LOCK)
            if mark is not None:
                self.store.delete(mark)

    def _lock_holder(self) -> tuple[dict, bytes]:
        """The lock's holder and its bytes; an unreadable one counts as the oldest (it is taken over)."""
        raw = b""
        try:
            with self.store.open_read(LOCK) as f:
                raw = f.read(4096)
            held = json.loads(raw)
            return {"action": str(held.get("action"))[:32], "host": str(held.get("host"))[:253],
                    "pid": str(held.get("pid"))[:16], "since": float(held["since"]), "token": held.get("token")}, raw
        except (NotFound, ValueError, TypeError, KeyError, AttributeError):  # released meanwhile, or unreadable
            return {"action": "change", "host": "?", "pid": "?", "since": 0.0, "token": None}, raw

    def _still(self, raw: bytes) -> bool:
        """Whether the lock still holds exactly ``raw`` (b"": none)."""
        return self._lock_holder()[1] == raw

    def record(self, event: dict) -> dict:
        """Add a decision that changes nothing served (a refusal) to the history; returns the event."""
        with self._changing("refusal"):
            return self._record(event)

    def _record(self, event: dict) -> dict:
        history = self.history()
        event = {"time": _now(), **event}
        history["events"].append(event)
        self._write_history(history)
        return event

    def promote(self, candidate: str, evidence: dict) -> dict:
        """Copy the drafter export at ``candidate`` into a new version and into ``current/``; returns the event."""
        with self._changing("promotion"):
            return self._promote(candidate, evidence)

    def _promote(self, candidate: str, evidence: dict) -> dict:
        source = open_store(candidate, endpoint_url=self.endpoint_url)
        files = sorted(visible(source.list("")))
        if "config.json" not in files:
            raise PromotionError(f"{candidate}: no config.json (not a drafter export)")
        history = self.history()
        version = max([0, *self._versions(), *history["stack"]]) + 1
        with tempfile.TemporaryDirectory(prefix="dflash-promote-") as tmp:
            _copy(source, "", self.store, f"{VERSIONS}{version}/", files, Path(tmp))
            _replace(self.store, f"{VERSIONS}{version}/", CURRENT, Path(tmp))
        event = {"time": _now(), "action": "promoted", "version": version, "candidate": candidate, **evidence}
        history["stack"].append(version)
        history["events"].append(event)
        self._write_history(history)
        return event

    def rollback(self, reason: str = "") -> dict:
        """Restore the version that was current before the current one, byte for byte; returns the event."""
        with self._changing("rollback"):
            return self._rollback(reason)

    def _rollback(self, reason: str) -> dict:
        history = self.history()
        if len(history["stack"]) < 2:
            raise PromotionError(f"{self.uri}: no earlier version to roll back to "
                                 f"(versions current so far: {history['stack'] or 'none'})")
        undone, restored = history["stack"][-1], history["stack"][-2]
        with tempfile.TemporaryDirectory(prefix="dflash-rollback-") as tmp:
            _replace(self.store, f"{VERSIONS}{restored}/", CURRENT, Path(tmp))
        event = {"time": _now(), "action": "rolled_back", "version": restored, "undone": undone,
                 **({"reason": reason} if reason else {})}
        history["stack"].pop()
        history["events"].append(event)
        self._write_history(history)
        return event


def _copy(src: ObjectStore, src_prefix: str, dst: ObjectStore, dst_prefix: str, files: list[str], tmp: Path) -> None:
    """Copy ``files`` (relative keys) through a local file each, so a large weights file is never held in memory."""
    for rel in files:
        local = tmp / "f"
        src.get_file(src_prefix + rel, local)
        dst.put_file(dst_prefix + rel, local)
        local.unlink()


def _replace(store: ObjectStore, version_prefix: str, current: str, tmp: Path) -> None:
    """Make ``current`` hold exactly the files of ``version_prefix``: copy each over, then remove the rest."""
    files = sorted(k[len(version_prefix):] for k in visible(store.list(version_prefix)))
    if not files:
        raise PromotionError(f"{store.url(version_prefix)}: the version holds no files")
    _copy(store, version_prefix, store, current, files, tmp)
    for key in list(visible(store.list(current))):
        if key[len(current):] not in files:
            store.delete(key)
