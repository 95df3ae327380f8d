"""The canonical form of a storage URI, the one form every URI a job names must have.

* ``s3://bucket/key/path`` (a valid bucket name; no user, port, query or fragment), or
* ``file:///absolute/path`` or a bare absolute path ``/absolute/path``;

and never a NUL or control character, a backslash, an encoded ``.`` / ``/`` / ``\\``, a ``.`` or
``..`` segment, an empty segment (``a//b``), a host part (``file://host/x``) or the one-slash form
``file:/x``. Whether a URI lies inside the operator's roots is :mod:`.storage_roots`' rule.
"""

from __future__ import annotations

import re
import unicodedata

from dfp_shared.storage.store import AccessRefused

MAX_URI_LENGTH = 2048
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_ENCODED = re.compile(r"%(2e|2f|5c|00)", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_INVISIBLE = {"Cf", "Zl", "Zp"}  # bidi overrides, zero-width characters, line separators


def uri_scheme(uri: str) -> str:
    """The URI's scheme in lower case (``s3``, ``file``, ...), or "" for a bare path."""
    match = _SCHEME.match(uri)
    return match.group(1).lower() if match else ""


class OutsideRoots(AccessRefused):
    """A URI is not canonical or lies outside every allowed root."""


def canonical_uri(uri: str) -> str:
    """The canonical form of a storage URI (``s3://...`` or ``file:///...``); raises OutsideRoots."""
    if not isinstance(uri, str) or not uri:
        raise OutsideRoots("empty storage URI")
    if len(uri) > MAX_URI_LENGTH:
        raise OutsideRoots(f"storage URI longer than {MAX_URI_LENGTH} characters")
    if _CONTROL.search(uri) or "\\" in uri or any(unicodedata.category(c) in _INVISIBLE for c in uri):
        raise OutsideRoots(f"{uri!r}: control characters and backslashes are not allowed in storage URIs")
    if _ENCODED.search(uri):
        raise OutsideRoots(f"{uri!r}: percent-encoded '.', '/', '\\' or NUL are not allowed")
    scheme = uri_scheme(uri)
    if scheme == "s3":
        if not uri.startswith("s3://"):
            raise OutsideRoots(f"{uri!r}: write s3 URIs as s3://bucket/key")
        bucket, _, key = uri[len("s3://"):].partition("/")
        if not _BUCKET.match(bucket) or ".." in bucket:
            raise OutsideRoots(f"{uri!r}: {bucket!r} is not a valid bucket name (no user, port or host part)")
        _check_segments(uri, key)
        if "?" in key or "#" in key:
            raise OutsideRoots(f"{uri!r}: query and fragment parts are not allowed")
        return f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
    if scheme == "file":
        if not uri.startswith("file:///"):
            raise OutsideRoots(f"{uri!r}: local storage URIs are file:///absolute/path (no host part, "
                               "no relative path, not file:/path)")
        path = uri[len("file://"):]
    elif scheme:
        raise OutsideRoots(f"{uri!r}: URI scheme {scheme!r} is not allowed (use s3:// or file:///)")
    elif uri.startswith("/"):
        path = uri
    else:
        raise OutsideRoots(f"{uri!r}: a local path must be absolute (or use file:///...)")
    _check_segments(uri, path[1:])  # one leading slash: "//x" is an empty segment
    return "file://" + path


def _check_segments(uri: str, path: str) -> None:
    parts = path.split("/")
    if parts and parts[-1] == "":
        parts = parts[:-1]  # a trailing slash names a prefix
    for part in parts:
        if part in ("", ".", ".."):
            raise OutsideRoots(f"{uri!r}: '.', '..' and empty path segments are not allowed")
