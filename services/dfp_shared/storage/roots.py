"""Storage confinement: every URI a job names must be canonical and lie inside the operator's roots.

The operator sets the storage root (``DFLASH_STORAGE_URL``) and may allow more prefixes
(``DFLASH_ALLOWED_PREFIXES``). The API checks every storage URI of a spec against them when it
accepts a job, and every worker checks them again before any I/O (a task in Redis may come from
anyone who can write to Redis). URIs are compared in their canonical form (:mod:`.storage_uris`);
local paths also after resolving symlinks, so a link inside a root that points out of it does not
count as inside.

Inside the roots the operator may keep prefixes for one principal's jobs (``DFLASH_RESERVED_PREFIXES``:
the served drafters and the adaptation runs, kept for the adaptation loop's key) or for none (the captured
traffic, which the loop reads with its own credentials): no other principal's job may name a URI inside
such a prefix, or one that holds it, to read or to write.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence

from dfp_shared.storage.uris import OutsideRoots, canonical_uri, uri_scheme


def _operator_root(uri: str) -> str:
    """An operator-given root in canonical form; local roots may be relative and are resolved."""
    uri = uri.strip()
    if uri.startswith("file://") and not uri.startswith("file:///"):
        uri = uri[len("file://"):]  # file://./rel, as the embedded default is written
    if not uri_scheme(uri) and not uri.startswith("/"):
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


PRINCIPAL_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
"""What an API key entry's ``name`` (the principal owning its jobs) may be."""


def parse_reservations(value: str | Mapping | None) -> dict[str, str | None]:
    """``DFLASH_RESERVED_PREFIXES``: a JSON object of storage prefix -> principal name ("" or null: no job's),
    each prefix in canonical form. Raises ValueError naming what is wrong."""
    if not value:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError("expected a JSON object of storage prefix -> principal name") from None
    if not isinstance(value, Mapping):
        raise ValueError("expected a JSON object of storage prefix -> principal name")
    reserved = {}
    for prefix, principal in value.items():
        if principal not in (None, "") and not (isinstance(principal, str) and PRINCIPAL_NAME.match(principal)):
            raise ValueError(f"{prefix}: the principal must be an API key's name ([A-Za-z0-9_.@-], at most 64) or "
                             f"empty for no job's, got {principal!r}")
        try:
            reserved[_operator_root(prefix)] = principal or None
        except OutsideRoots as exc:
            raise ValueError(f"reserved prefix {prefix}: {exc}") from None
    return reserved


def parse_prefixes(value: str | Sequence[str] | None) -> list[str]:
    """``DFLASH_ALLOWED_PREFIXES``: a comma-separated list (or a list) of ``file://`` / ``s3://`` prefixes."""
    if not value:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [item.strip() for item in items if item and item.strip()]


class StorageRoots:
    """The roots a job may read and write: the storage root first, then the allowed prefixes."""

    def __init__(self, roots: Iterable[str], reserved: Mapping[str, str | None] | None = None):
        self.roots = list(dict.fromkeys(_operator_root(r) for r in roots))
        if not self.roots:
            raise ValueError("no storage root configured")
        self.reserved = parse_reservations(reserved)

    @classmethod
    def from_settings(cls, settings) -> StorageRoots:
        """From a service's settings (:class:`~dfp_shared.config.CommonSettings`)."""
        return cls([settings.storage_url, *parse_prefixes(settings.allowed_prefixes)],
                   parse_reservations(getattr(settings, "reserved_prefixes", "")))

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
        for field, uri in self._spec_uris(job_type, spec, prefix):
            if field.endswith(".output") and uri is None:
                raise OutsideRoots(f"{field}: unset (jobs get a per-job prefix when they are submitted)")
            if uri is not None:
                self.check(uri, field)

    def check_reservations(self, job_type: str, spec, owner: str | None, prefix: str = "spec") -> None:
        """Refuse a spec of ``owner``'s (None: the anonymous principal's) that names a URI inside a reserved prefix
        kept for another principal or for none, or a URI that holds one."""
        if not self.reserved:
            return
        for field, uri in self._spec_uris(job_type, spec, prefix):
            if uri is not None:
                self.check_reserved(uri, owner, field)

    def check_reserved(self, uri: str, owner: str | None, field: str) -> None:
        """Refuse ``uri`` (a local one also where its symlinks lead) for ``owner`` (None: the anonymous principal)
        if it lies inside or holds a prefix kept for another principal or for none."""
        owner = owner or "anonymous"
        forms = self._forms(uri, field)
        for kept, principal in self.reserved.items():
            if principal != owner and any(_within(f, kept) or _within(kept, f) for f in forms):
                whose = f"kept for the jobs of {principal!r}" if principal else "which no job may read or write"
                raise OutsideRoots(f"{field}: {uri} is or holds {kept}/, {whose}")

    def _forms(self, uri: str, field: str) -> set[str]:
        """``uri`` canonical, and a local one also with its symlinks resolved."""
        return {self._canonical(uri, field).rstrip("/"), self._resolved(uri, field)}

    def _resolved(self, uri: str, field: str) -> str:
        """``uri`` canonical, a local one with its symlinks resolved."""
        canonical = self._canonical(uri, field).rstrip("/")
        if canonical.startswith("file://"):
            return "file://" + os.path.realpath(canonical[len("file://"):])
        return canonical

    @staticmethod
    def _spec_uris(job_type: str, spec, prefix: str):
        """(field, URI or None) for every storage field of a job spec (a model or its dict; pipelines stage by
        stage); ``output`` always, even unset."""
        from dfp_shared.jobs.types import JOB_TYPES, PIPELINE
        from dfp_shared.specs import PipelineSpec
        from dfp_shared.specs._common import storage_fields

        data = spec.model_dump() if hasattr(spec, "model_dump") else dict(spec)
        if job_type == PIPELINE.name:
            for stage in PipelineSpec.stages_of(data):
                yield from StorageRoots._spec_uris(stage, data.get(stage) or {}, f"{prefix}.{stage}")
            return
        yield f"{prefix}.output", data.get("output")
        for name in storage_fields(JOB_TYPES[job_type].spec):
            value = data.get(name)
            if isinstance(value, list):  # a list of URIs (an evaluate job's prompt sets)
                for i, item in enumerate(value):
                    yield f"{prefix}.{name}.{i}", item
            elif value is not None and name != "output":
                yield f"{prefix}.{name}", value

    def check_inside(self, uri: str, prefix: str, field: str) -> str:
        """``uri`` checked against the roots and also lying under ``prefix`` (e.g. a task's file under the
        spec's input), a local one also where its symlinks lead."""
        canonical = self.check(uri, field)
        if not (_within(canonical, self._canonical(prefix, field))
                and _within(self._resolved(uri, field), self._resolved(prefix, field))):
            raise OutsideRoots(f"{field}: {uri} is not under {prefix}")
        return canonical
