"""Output ownership: a job writes only under a prefix that is new or that its own principal created.

The first job that writes under an output prefix leaves a marker there, ``.dflash-owner.json``
(``{"owner", "job_id", "created_at"}``), created atomically (an exclusive create on local disks, a
conditional ``If-None-Match: *`` write on S3), so of two jobs racing for a new prefix exactly one
wins. A later job may write there only if it runs for the same principal; a prefix that already holds
objects but no marker (data no job wrote) is refused too, and so are any prefix below another
principal's, every storage root itself, and ``<root>/jobs/`` but for a job's own per-job prefix. So a train job never resumes from, overwrites or deletes another principal's
checkpoints, and a tokenize job never replaces another's ``manifest.json``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from dfp_shared.storage.roots import StorageRoots
from dfp_shared.storage.store import AccessRefused, NotFound, ObjectStore, open_store

log = logging.getLogger(__name__)

MARKER = ".dflash-owner.json"
ANONYMOUS = "anonymous"


class OutputOwned(AccessRefused):
    """The output prefix belongs to another principal (or holds data no job wrote)."""


def _marker_owner(store: ObjectStore) -> str | None:
    try:
        return json.loads(store.get(MARKER)).get("owner") or ANONYMOUS
    except NotFound:
        return None
    except ValueError:
        return "<unreadable marker>"


class OutputClaims:
    """Claims output prefixes for principals; remembers this process's successful claims."""

    def __init__(self, roots: StorageRoots, endpoint_url: str | None = None):
        self.roots = roots
        self.endpoint_url = endpoint_url
        self._claimed: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def _store(self, uri: str) -> ObjectStore:
        return open_store(uri, endpoint_url=self.endpoint_url)

    def claim(self, uri: str, owner: str | None, job_id: str, field: str = "spec.output",
              parent_id: str | None = None) -> None:
        """Let ``owner`` write under ``uri``, or raise OutputOwned naming the prefix and its owner.

        ``job_id`` (and the pipeline's ``parent_id``) name the only per-job prefixes under
        ``<root>/jobs/`` this job may write: that area is reserved for jobs without an explicit output.
        """
        owner = owner or ANONYMOUS
        prefix = self._resolved(self.roots.check(uri, field))
        if (prefix, owner) in self._claimed:
            return
        with self._lock:
            self._check_reserved(prefix, job_id, parent_id, field)
            self._claim(prefix, owner, job_id, field)
            self._claimed.add((prefix, owner))

    @staticmethod
    def _resolved(canonical: str) -> str:
        """The prefix as it really is: local paths with their symlinks resolved (the walk below must see
        the directories a write will land in)."""
        if canonical.startswith("file://"):
            return "file://" + os.path.realpath(canonical[len("file://"):])
        return canonical.rstrip("/")

    def _check_reserved(self, prefix: str, job_id: str, parent_id: str | None, field: str) -> None:
        area = self.roots.jobs_area
        if not (prefix == area or prefix.startswith(area + "/")):
            return
        own = [self.roots.job_prefix(job_id).rstrip("/")]
        if parent_id:
            own.append(self.roots.job_prefix(parent_id).rstrip("/"))
        rel = {prefix[len(p) + 1:] for p in own if prefix.startswith(p + "/")}
        if prefix not in own and not any(part and "/" not in part for part in rel):
            raise OutputOwned(f"{field}: {area}/ is reserved for the prefixes of jobs without an output; "
                              "choose an output prefix elsewhere")

    def _claim(self, prefix: str, owner: str, job_id: str, field: str) -> None:
        root = self.roots.root_of(prefix, field)
        if prefix in self.roots.roots:
            raise OutputOwned(f"{field}: {prefix}/ is a storage root shared by every job; write under a prefix "
                              "below it")
        # every level from the root down to the prefix's parent: none may belong to someone else
        rel = prefix[len(root):].strip("/")
        parts = rel.split("/") if rel else []
        for depth in range(len(parts)):
            level = "/".join([root, *parts[:depth]])
            holder = _marker_owner(self._store(level))
            if holder is not None and holder != owner:
                raise OutputOwned(f"{field}: {prefix}/ lies inside {level}/, which belongs to {holder!r}; "
                                  "choose an output prefix of your own")
        store = self._store(prefix)
        holder = _marker_owner(store)
        if holder is None:
            # anything at all below it (another principal's marker too) means the prefix is not new
            if next(iter(store.list("")), None) is not None:
                raise OutputOwned(f"{field}: {prefix}/ already holds data that no job of {owner!r} wrote; "
                                  "choose a new output prefix")
            marker = json.dumps({"owner": owner, "job_id": job_id, "created_at": time.time()}).encode()
            if store.put_if_absent(MARKER, marker):
                log.info("output prefix claimed", extra={"prefix": prefix, "owner": owner, "job_id": job_id})
                return
            holder = _marker_owner(store)  # another job won the race
        if holder != owner:
            raise OutputOwned(f"{field}: {prefix}/ belongs to {holder!r}; a job may write only under a new "
                              "prefix or one its own principal created")
