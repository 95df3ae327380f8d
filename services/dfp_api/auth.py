"""API keys: configured as SHA-256 hashes with scopes, checked in constant time.

A key entry is ``{"name": "ci", "sha256": "<hex digest of the key>", "scopes": ["read", "write"]}``.
``write`` implies ``read``. The plaintext key is never stored, logged or returned; only the
entry's ``name`` identifies the caller (in logs and rate limits).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

SCOPES = ("read", "write")


class ApiKeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.@-]+$", description="Who holds the key.")
    sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$", description="Hex SHA-256 digest of the key.")
    scopes: list[str] = Field(default_factory=lambda: ["read"], description="Granted scopes: read, write.")

    @field_validator("scopes")
    @classmethod
    def _known_scopes(cls, scopes: list[str]) -> list[str]:
        unknown = sorted(set(scopes) - set(SCOPES))
        if unknown:
            raise ValueError(f"unknown scope(s) {unknown}; allowed: {list(SCOPES)}")
        return scopes


_ENTRIES = TypeAdapter(list[ApiKeyEntry])


@dataclass(frozen=True)
class Principal:
    """The authenticated caller."""

    name: str
    scopes: frozenset[str]

    def allows(self, scope: str) -> bool:
        return scope in self.scopes or (scope == "read" and "write" in self.scopes)


ANONYMOUS = Principal("anonymous", frozenset(SCOPES))


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_key() -> str:
    """A fresh random API key (43 URL-safe characters, 256 bits)."""
    return "dfp_" + secrets.token_urlsafe(32)


def parse_keys(value: str) -> list[ApiKeyEntry]:
    """Parse DFLASH_API_KEYS: inline JSON/YAML, or the path of a file holding it. Raises ValueError."""
    text, source = value, "DFLASH_API_KEYS"
    stripped = value.strip()
    if stripped and stripped[0] not in "[{-":
        path = Path(stripped)
        if not path.is_file():
            raise ValueError(f"{stripped!r} is neither a JSON list of keys nor a readable file")
        text, source = path.read_text(), str(path)
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
        self._entries = [(bytes.fromhex(e.sha256.lower()), Principal(e.name, frozenset(e.scopes))) for e in entries]

    def authenticate(self, token: str) -> Principal | None:
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        found = None
        for want, principal in self._entries:
            if hmac.compare_digest(digest, want) and found is None:
                found = principal
        return found


def key_entry_json(name: str, key: str, scopes: list[str]) -> str:
    return json.dumps({"name": name, "sha256": hash_key(key), "scopes": scopes})
