"""API keys: configured as SHA-256 hashes with scopes and an optional expiry, checked in constant time.

A key entry is ``{"name": "ci", "sha256": "<hex digest of the key>", "scopes": ["read", "write"],
"expires_at": "2030-01-01T00:00:00Z"}`` (``expires_at`` optional: ISO 8601, UTC when no offset is
given, or Unix seconds). ``write`` implies ``read``; ``admin`` implies both and sees every
principal's jobs. The plaintext key is never stored, logged or returned; only the entry's ``name``
identifies the caller (in logs, rate limits and as the owner of the jobs it submits).

When ``DFLASH_API_KEYS`` names a file (a mounted Secret), :class:`KeySet` re-reads it when it
changes (checked at most once a second), so a revoked key is refused without a restart. A file
that becomes empty, invalid or disappears fails closed: no key is accepted until a valid file is
back (keeping the last good set would keep a key just revoked working), and the error is logged.

The name ``anonymous`` is reserved: it owns the jobs created with auth disabled and ownerless
outputs, so no key may act as that principal.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from datetime import date, datetime, timezone
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

log = logging.getLogger(__name__)

SCOPES = ("read", "write", "admin")
RESERVED_NAMES = frozenset({"anonymous"})
"""Names no key entry may take (compared case-insensitively): ``anonymous`` owns the jobs created with
auth disabled and outputs without an owner marker."""
UNLOADABLE = "the API key set could not be loaded; ask the operator"
"""The 401 message while a reloaded key file is empty, invalid or missing."""
IMPLIED = {"read": frozenset({"read"}), "write": frozenset({"read", "write"}),
           "admin": frozenset({"read", "write", "admin"})}


def parse_expiry(value: object) -> datetime:
    """An expiry as a UTC datetime: ISO 8601 (no offset means UTC) or Unix seconds. Raises ValueError."""
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, date):  # YAML reads a bare 2030-01-01 as a date: its midnight, UTC
        moment = datetime(value.year, value.month, value.day)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            moment = datetime.fromtimestamp(value, timezone.utc)
        except (OverflowError, OSError, ValueError):
            raise ValueError(f"Unix time {value!r} out of range") from None
    elif isinstance(value, str) and value.strip().lstrip("-").replace(".", "", 1).isdigit():
        return parse_expiry(float(value))
    elif isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.strip())
        except ValueError:
            raise ValueError(f"expected ISO 8601 (e.g. 2030-01-01T00:00:00Z) or Unix seconds, got {value!r}") from None
    else:
        raise ValueError(f"expected ISO 8601 (e.g. 2030-01-01T00:00:00Z) or Unix seconds, got {value!r}")
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


def format_expiry(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


class ApiKeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.@-]+$", description="Who holds the key.")
    sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$", description="Hex SHA-256 digest of the key.")
    scopes: list[str] = Field(default_factory=lambda: ["read"], description="Granted scopes: read, write, admin.")
    expires_at: datetime | None = Field(None, description="When the key stops working: ISO 8601 or Unix seconds.")

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        check_name(name)
        return name

    @field_validator("expires_at", mode="before")
    @classmethod
    def _expiry(cls, value: object) -> datetime | None:
        return None if value is None else parse_expiry(value)

    @field_validator("scopes")
    @classmethod
    def _known_scopes(cls, scopes: list[str]) -> list[str]:
        unknown = sorted(set(scopes) - set(SCOPES))
        if unknown:
            raise ValueError(f"unknown scope(s) {unknown}; allowed: {list(SCOPES)}")
        return scopes


def check_name(name: str) -> None:
    """Raise ValueError if ``name`` is reserved for a principal no key may be."""
    if name.lower() in RESERVED_NAMES:
        raise ValueError(f"the name {name!r} is reserved (it owns the jobs created with auth disabled and "
                         "outputs without an owner); choose another name")


_ENTRIES = TypeAdapter(list[ApiKeyEntry])


@dataclass(frozen=True)
class Principal:
    """The authenticated caller: its name is the owner of the jobs it submits."""

    name: str
    scopes: frozenset[str]
    expires_at: float | None = None
    """Unix time after which the key is refused (None: never)."""

    def __post_init__(self) -> None:  # held scopes with what they imply, so a check is one lookup
        object.__setattr__(self, "scopes", frozenset(self.scopes).union(*(IMPLIED.get(s, ()) for s in self.scopes)))

    def allows(self, scope: str) -> bool:
        return scope in self.scopes

    @property
    def sees_all(self) -> bool:
        """An admin sees and cancels every principal's jobs; others only their own."""
        return "admin" in self.scopes

    def may_see(self, owner: str | None) -> bool:
        return owner == self.name or "admin" in self.scopes

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


ANONYMOUS = Principal("anonymous", frozenset(SCOPES))


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    """A fresh random API key (43 URL-safe characters, 256 bits)."""
    return "dfp_" + secrets.token_urlsafe(32)


def key_file(value: str) -> Path | None:
    """The file DFLASH_API_KEYS names, or None when it holds the keys inline."""
    stripped = value.strip()
    return Path(stripped) if stripped and stripped[0] not in "[{-" else None


def parse_keys(value: str) -> list[ApiKeyEntry]:
    """Parse DFLASH_API_KEYS: inline JSON/YAML, or the path of a file holding it. Raises ValueError."""
    text, source = value, "DFLASH_API_KEYS"
    stripped = value.strip()
    path = key_file(value)
    if path is not None:
        if not path.is_file():
            raise ValueError(f"{stripped!r} is neither a JSON list of keys nor a readable file")
        text, source = path.read_text(), str(path)
    if not text.strip():
        raise ValueError(f"{source}: empty, no keys configured")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not valid JSON/YAML: {exc}") from None
    if isinstance(data, dict) and "keys" in data:
        data = data["keys"]
    try:
        entries = _ENTRIES.validate_python(data)
    except ValidationError as exc:
        problems = [f"entry {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise ValueError(f"{source}: " + "; ".join(problems)) from None
    names = [e.name for e in entries]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{source}: duplicate key names {dupes}")
    if not entries:
        raise ValueError(f"{source}: the list of keys is empty")
    return entries


class KeyRing:
    """Checks a presented bearer token against every configured hash (no early exit)."""

    def __init__(self, entries: list[ApiKeyEntry]):
        self._entries = [(bytes.fromhex(e.sha256.lower()),
                          Principal(e.name, frozenset(e.scopes), e.expires_at.timestamp() if e.expires_at else None))
                         for e in entries]
        self.size = len(entries)

    def authenticate(self, token: str) -> Principal | None:
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        found = None
        for want, principal in self._entries:
            if hmac.compare_digest(digest, want) and found is None:
                found = principal
        return found


class KeySet:
    """The configured keys, re-read from their file when it changes.

    Inline keys never change. A file is checked with one ``stat`` at most every ``check_every_s``
    (per process); a new inode, size or mtime (a Kubernetes Secret update swaps a symlink, an edit
    rewrites the file) re-reads it. A file that is empty, cannot be read or parsed fails closed: the
    key set becomes empty, :attr:`problem` says why (requests get :data:`UNLOADABLE`), and an error
    naming the file and the reason is logged once per change; the file is then looked at every
    ``retry_s`` so a valid one restores service promptly."""

    def __init__(self, value: str, check_every_s: float = 1.0, retry_s: float = 0.2):
        self._value = value
        self._path = key_file(value)
        self._every = check_every_s
        self._retry = min(retry_s, check_every_s)
        self._signature = self._stat()
        self.ring = KeyRing(parse_keys(value))  # at startup an invalid value is an error, not an empty set
        self.problem: str | None = None
        """Why the key file did not load (no key is accepted meanwhile); None when it did."""
        self._next_check = time.monotonic() + check_every_s

    def _stat(self) -> tuple | None:
        if self._path is None:
            return None
        try:
            st = os.stat(self._path)
        except OSError as exc:
            return ("missing", exc.errno)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def authenticate(self, token: str) -> Principal | None:
        """The key's principal, or None (unknown key, or :attr:`problem` says the set did not load)."""
        if self._path is not None and time.monotonic() >= self._next_check:
            self.refresh()
        return self.ring.authenticate(token)

    def refresh(self) -> None:
        """Re-read the file if it changed since the last look."""
        signature = self._stat()
        if signature == self._signature:
            self._next_check = time.monotonic() + (self._every if self.problem is None else self._retry)
            return
        self._signature = signature
        try:
            if signature is not None and signature[0] == "missing":
                raise ValueError(f"{self._path}: cannot read the key file ({os.strerror(signature[1])})")
            ring = KeyRing(parse_keys(self._value))
        except (ValueError, OSError) as exc:
            self.ring, self.problem = KeyRing([]), str(exc)
            self._next_check = time.monotonic() + self._retry
            log.error("API keys could not be reloaded, no key is accepted until the file is valid again: %s",
                      exc, extra={"path": str(self._path), "error": str(exc)})
            return
        self.ring, self.problem = ring, None
        self._next_check = time.monotonic() + self._every
        log.info("API keys reloaded", extra={"path": str(self._path), "keys": ring.size})


def key_entry_json(name: str, key: str, scopes: list[str], expires_at: datetime | None = None) -> str:
    entry: dict = {"name": name, "sha256": hash_key(key), "scopes": scopes}
    if expires_at is not None:
        entry["expires_at"] = format_expiry(expires_at)
    return json.dumps(entry)
