"""Storage confinement: every URI a job names must be canonical and lie inside the operator's roots.

The operator sets the storage root (``DFLASH_STORAGE_URL``) and may allow more prefixes
(``DFLASH_ALLOWED_PREFIXES``). The API checks every storage URI of a spec against them when it
accepts a job, and every worker checks them again before any I/O (a task in Redis may come from
anyone who can write to Redis). A URI has one canonical form:

* ``s3://bucket/key/path`` (a valid bucket name; no user, port, query or fragment), or
* ``file:///absolute/path`` or a bare absolute path ``/absolute/path``;

and never holds a NUL or control character, a backslash, an encoded ``.`` / ``/`` / ``\\``, a ``.``
or ``..`` segment, an empty segment (``a//b``), a host part (``file://host/x``) or the one-slash
form ``file:/x``. Local paths are also compared after resolving symlinks, so a link inside a root
that points out of it does not count as inside.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence

from .storage import AccessRefused

MAX_URI_LENGTH = 2048
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_ENCODED = re.compile(r"%(2e|2f|5c|00)", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class OutsideRoots(AccessRefused):
    """A URI is not canonical or lies outside every allowed root."""


def canonical_uri(uri: str) -> str:
    """The canonical form of a storage URI (``s3://...`` or ``file:///...``); raises OutsideRoots."""
    if not isinstance(uri, str) or not uri:
        raise OutsideRoots("empty storage URI")
    if len(uri) > MAX_URI_LENGTH:
        raise OutsideRoots(f"storage URI longer than {MAX_URI_LENGTH} characters")
    if _CONTROL.search(uri) or "\\" in uri:
        raise OutsideRoots(f"{uri!r}: control characters and backslashes are not allowed in storage URIs")
    if _ENCODED.search(uri):
        raise OutsideRoots(f"{uri!r}: percent-encoded '.', '/', '\\' or NUL are not allowed")
    match = _SCHEME.match(uri)
    scheme = match.group(1).lower() if match else ""
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
    _check_segments(uri, path.lstrip("/"))
    return "file://" + path


def _check_segments(uri: str, path: str) -> None:
    parts = path.split("/")
    if parts and parts[-1] == "":
        parts = parts[:-1]  # a trailing slash names a prefix
    for part in parts:
        if part in ("", ".", ".."):
            raise OutsideRoots(f"{uri!r}: '.', '..' and empty path segments are not allowed")


def _operator_root(uri: str) -> str:
    """An operator-given root in canonical form; local roots may be relative and are resolved."""
    uri = uri.strip()
    if uri.startswith("file://") and not uri.startswith("file:///"):
        uri = uri[len("file://"):]  # file://./rel, as the embedded default is written
    if not _SCHEME.match(uri) and not uri.startswith("/"):
        uri = os.path.abspath(uri)
    canonical = canonical_uri(uri)
    if canonical.startswith("file://"):
        canonical = "file://" + os.path.realpath(canonical[len("file://"):])
    return canonical.rstrip("/")


def _within(path: str, root: str) -> bool:
    path, root = path.rstrip("/"), root.rstrip("/")
    return path == root or path.startswith(root + "/")


def parent_prefix(uri: str) -> str:
    """The prefix that holds ``uri`` (its parent directory or key prefix), canonical."""
    canonical = canonical_uri(uri).rstrip("/")
    head, _, _ = canonical.rpartition("/")
    return head if head not in ("file:/", "s3:/") else canonical


def parse_prefixes(value: str | Sequence[str] | None) -> list[str]:
    """``DFLASH_ALLOWED_PREFIXES``: a comma-separated list (or a list) of ``file://`` / ``s3://`` prefixes."""
    if not value:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [item.strip() for item in items if item and item.strip()]


class StorageRoots:
    """The roots a job may read and write: the storage root first, then the allowed prefixes."""

    def __init__(self, roots: Iterable[str]):
        self.roots = list(dict.fromkeys(_operator_root(r) for r in roots))
        if not self.roots:
            raise ValueError("no storage root configured")

    @classmethod
    def from_settings(cls, settings) -> StorageRoots:
        """From a service's settings (:class:`~dfp_shared.config.CommonSettings`)."""
        return cls([settings.storage_url, *parse_prefixes(settings.allowed_prefixes)])

    @property
    def default(self) -> str:
        """The storage root (``DFLASH_STORAGE_URL``): where jobs without an ``output`` write."""
        return self.roots[0]

    @property
    def jobs_area(self) -> str:
        """``<root>/jobs``: reserved for the outputs of jobs that name none (see :meth:`job_prefix`)."""
        return self.default + "/jobs"

    def job_prefix(self, job_id: str, *parts: str) -> str:
        """The per-job output prefix under the storage root."""
        return "/".join([self.jobs_area, job_id, *parts]) + "/"

    def check_explicit_output(self, uri: str, field: str) -> None:
        """An output a spec names must not lie in the per-job area (it would take a future job's prefix)."""
        canonical = self._canonical(uri, field).rstrip("/")
        if canonical == self.jobs_area or canonical.startswith(self.jobs_area + "/"):
            raise OutsideRoots(f"{field}: {self.jobs_area}/ is reserved for jobs without an output; "
                               "name an output prefix elsewhere, or none")

    def root_of(self, uri: str, field: str = "uri") -> str:
        """The allowed root that holds ``uri``; raises OutsideRoots naming ``field``."""
        canonical = self._canonical(uri, field)
        resolved = canonical
        if canonical.startswith("file://"):
            resolved = "file://" + os.path.realpath(canonical[len("file://"):])
        for root in self.roots:
            if _within(canonical, root) and _within(resolved, root):
                return root
        raise OutsideRoots(f"{field}: {uri} is outside the allowed storage ({', '.join(self.roots)})")

    def check(self, uri: str, field: str = "uri") -> str:
        """``uri`` in canonical form if it lies inside an allowed root; raises OutsideRoots naming ``field``."""
        self.root_of(uri, field)
        return canonical_uri(uri)

    @staticmethod
    def _canonical(uri: str, field: str) -> str:
        try:
            return canonical_uri(uri)
        except OutsideRoots as exc:
            raise OutsideRoots(f"{field}: {exc}") from None

    def check_spec(self, job_type: str, spec, prefix: str = "spec") -> None:
        """Check every storage URI of a job spec (a model or its dict; pipelines stage by stage)."""
        from .specs import SPECS, PipelineSpec
        from .specs._common import storage_fields

        data = spec.model_dump() if hasattr(spec, "model_dump") else dict(spec)
        if job_type == "pipeline":
            for stage in PipelineSpec.STAGES:
                self.check_spec(stage, data.get(stage) or {}, f"{prefix}.{stage}")
            return
        if data.get("output") is None:
            raise OutsideRoots(f"{prefix}.output: unset (jobs get a per-job prefix when they are submitted)")
        for name in storage_fields(SPECS[job_type]):
            value = data.get(name)
            if value is not None:
                self.check(value, f"{prefix}.{name}")

    def check_inside(self, uri: str, prefix: str, field: str) -> str:
        """``uri`` checked against the roots and also lying under ``prefix`` (e.g. a task's file under the
        spec's input)."""
        canonical = self.check(uri, field)
        if not _within(canonical, self._canonical(prefix, field)):
            raise OutsideRoots(f"{field}: {uri} is not under {prefix}")
        return canonical
