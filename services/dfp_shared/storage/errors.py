"""The stores' errors: what a caller sees when a storage operation fails for good."""

from __future__ import annotations


class StorageError(Exception):
    """A storage operation failed for a reason the caller should see (not transient)."""


class NotFound(StorageError, FileNotFoundError):
    """The key (or bucket) does not exist."""


class AccessRefused(StorageError):
    """A job may not touch this storage (outside the operator's roots, a symlink out of a store, another
    principal's output). Workers fail the job at once instead of retrying: a retry cannot succeed."""
