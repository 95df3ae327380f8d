"""Same-node fast path: hidden states through POSIX shared memory, gRPC carrying only handles.

When the trainer and the target share a node (the target as a sidecar sharing a memory-backed
``/dev/shm``), the client creates a segment (a file in the shared directory), names it in the
request, and the server writes every sequence's tensor into it; the reply carries offsets only.

Ownership and cleanup: the client owns its segments. Each client holds an exclusive ``flock`` on
its own lock file ``dfp-hs-<owner>.lock`` for its whole life, and names its segments
``dfp-hs-<owner>-<n>.seg``. Segments are reused across requests (a small pool) and unlinked when
the client closes. When a client dies, the kernel drops its lock, and :func:`sweep` (run by the
server at start-up, periodically, and whenever a call is cancelled) removes the segments of every
owner whose lock can be taken. ``flock`` works across containers that mount the same tmpfs, so
this needs no shared PID namespace. If the server dies, the client is the survivor: its segments
stay in its pool and are unlinked on close.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import threading
import uuid
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DEFAULT_DIR = "/dev/shm"
PREFIX = "dfp-hs"
_SEGMENT_RE = re.compile(rf"^{PREFIX}-(?P<owner>\d+-[0-9a-f]{{8}})-(?P<n>\d+)\.seg$")
_LOCK_RE = re.compile(rf"^{PREFIX}-(?P<owner>\d+-[0-9a-f]{{8}})\.lock$")
_ALIGN = 1 << 20


class ShmError(ValueError):
    pass


class Segment:
    """One mapped segment file."""

    def __init__(self, path: Path, size: int, create: bool):
        self.path = path
        self.name = path.name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(self.fd, size)
            actual = os.fstat(self.fd).st_size
            if actual < size:
                raise ShmError(f"shared-memory segment {path.name} holds {actual} bytes, {size} needed")
            self.size = actual
            self.mm = mmap.mmap(self.fd, actual)
        except BaseException:
            os.close(self.fd)
            raise

    def write(self, offset: int, tensor: torch.Tensor) -> int:
        """Copy a contiguous CPU tensor's bytes to ``offset``; returns the byte count."""
        src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        n = src.numel()
        if offset + n > self.size:
            raise ShmError(f"segment {self.name}: {n} bytes at offset {offset} overrun its {self.size} bytes")
        if n:
            torch.frombuffer(self.mm, dtype=torch.uint8, count=n, offset=offset).copy_(src)
        return n

    def view(self, offset: int, dtype: torch.dtype, shape: list[int], on_free=None) -> torch.Tensor:
        """A zero-copy tensor over the segment; ``on_free()`` runs once no tensor uses that memory any more.

        The view goes through a numpy array (which supports weak references and is what every derived
        torch view keeps alive), so the segment is reused only after the caller dropped every view.
        """
        import weakref

        import numpy as np

        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > self.size:
            raise ShmError(f"segment {self.name}: tensor at offset {offset} overruns its {self.size} bytes")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        array = np.frombuffer(self.mm, dtype=np.uint8, count=nbytes, offset=offset)
        if on_free is not None:
            weakref.finalize(array, on_free)
        return torch.from_numpy(array).view(dtype).view(shape)

    def read(self, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        """A fresh tensor copied out of the segment (the segment can be reused at once)."""
        numel = 1
        for s in shape:
            numel *= int(s)
        out = torch.empty(shape, dtype=dtype)
        if numel:
            nbytes = numel * out.element_size()
            if offset + nbytes > self.size:
                raise ShmError(f"segment {self.name}: tensor at offset {offset} overruns its {self.size} bytes")
            view = torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=offset)
            out.view(-1).view(torch.uint8).copy_(view)
            del view
        return out

    def close(self) -> None:
        try:
            self.mm.close()
        finally:
            os.close(self.fd)

    def unlink(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def check_name(name: str) -> str:
    if not _SEGMENT_RE.match(name):
        raise ShmError(f"invalid shared-memory segment name {name!r}")
    return name


def open_segment(directory: str | Path, name: str, size: int) -> Segment:
    """Server side: map an existing client segment of at least ``size`` bytes."""
    path = Path(directory) / check_name(name)
    try:
        return Segment(path, size, create=False)
    except FileNotFoundError:
        raise ShmError(f"shared-memory segment {name} does not exist in {directory} "
                       "(is the shared-memory directory mounted on both sides?)") from None


class SegmentCache:
    """Server side: mappings of client segments kept across calls (clients reuse their segments).

    An entry is dropped when its file is gone or was replaced (client closed or died), on use and
    on :meth:`prune`, so no mapping keeps a removed segment's memory alive for long.
    """

    def __init__(self, directory: str | Path, max_entries: int = 64):
        self.directory = Path(directory)
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[int, Segment]] = {}

    def open(self, name: str, size: int) -> Segment:
        path = self.directory / check_name(name)
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:
            raise ShmError(f"shared-memory segment {name} does not exist in {self.directory} "
                           "(is the shared-memory directory mounted on both sides?)") from None
        with self._lock:
            entry = self._entries.pop(name, None)
            if entry and entry[0] == inode and entry[1].size >= size:
                self._entries[name] = entry  # most recently used last
                return entry[1]
        if entry:
            _close_quietly(entry[1])
        seg = open_segment(self.directory, name, size)
        with self._lock:
            self._entries[name] = (inode, seg)
            while len(self._entries) > self.max_entries:
                _close_quietly(self._entries.pop(next(iter(self._entries)))[1])
        return seg

    def prune(self) -> None:
        with self._lock:
            for name, (inode, seg) in list(self._entries.items()):
                try:
                    alive = os.stat(self.directory / name).st_ino == inode
                except FileNotFoundError:
                    alive = False
                if not alive:
                    del self._entries[name]
                    _close_quietly(seg)

    def close(self) -> None:
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for _, seg in entries:
            _close_quietly(seg)


def _close_quietly(seg: Segment) -> None:
    try:
        seg.close()
    except (BufferError, OSError):
        pass


def sweep(directory: str | Path) -> list[str]:
    """Remove the segments and lock files of owners that are gone; returns the names removed."""
    directory = Path(directory)
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    live: set[str] = set()
    for name in names:
        m = _LOCK_RE.match(name)
        if not m:
            continue
        owner = m.group("owner")
        try:
            fd = os.open(directory / name, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            live.add(owner)  # the owner still holds it
            os.close(fd)
            continue
        try:  # owner dead: its segments first, then its lock
            for seg in names:
                sm = _SEGMENT_RE.match(seg)
                if sm and sm.group("owner") == owner:
                    (directory / seg).unlink(missing_ok=True)
                    removed.append(seg)
            (directory / name).unlink(missing_ok=True)
            removed.append(name)
        finally:
            os.close(fd)
    for name in names:  # segments with no lock file at all are orphans
        sm = _SEGMENT_RE.match(name)
        if sm and sm.group("owner") not in live and name not in removed:
            if not (directory / f"{PREFIX}-{sm.group('owner')}.lock").exists():
                (directory / name).unlink(missing_ok=True)
                removed.append(name)
    if removed:
        log.info("removed shared-memory segments of dead clients", extra={"count": len(removed)})
    return removed


class ShmPool:
    """Client side: segments owned by this process, reused across requests, unlinked on close."""

    def __init__(self, directory: str | Path = DEFAULT_DIR, max_cached_bytes: int = 2 << 30):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ShmError(f"shared-memory directory {self.directory} does not exist")
        self.owner = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.max_cached_bytes = max_cached_bytes
        self._lock = threading.Lock()
        self._free: list[Segment] = []
        self._all: dict[str, Segment] = {}
        self._holds: dict[str, int] = {}
        self._counter = 0
        final = self.directory / f"{PREFIX}-{self.owner}.lock"
        tmp = self.directory / f".{PREFIX}-{self.owner}.lock.tmp"
        self._lock_fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        os.rename(tmp, final)  # visible to sweepers only once locked
        self._lock_path = final
        self.closed = False

    def acquire(self, nbytes: int) -> Segment:
        """A segment of at least ``nbytes`` (the smallest free one that fits, else a new one)."""
        with self._lock:
            if self.closed:
                raise ShmError("shared-memory pool is closed")
            fits = [s for s in self._free if s.size >= nbytes]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                self._free.remove(seg)
                self._holds[seg.name] = 1
                return seg
            self._counter += 1
            name = f"{PREFIX}-{self.owner}-{self._counter}.seg"
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        seg = Segment(self.directory / name, size, create=True)
        with self._lock:
            self._all[name] = seg
            self._holds[name] = 1
        return seg

    def hold(self, seg: Segment) -> None:
        """One more user of ``seg`` (a tensor viewing it); :meth:`release` once per hold and per acquire."""
        with self._lock:
            self._holds[seg.name] = self._holds.get(seg.name, 0) + 1

    def release(self, seg: Segment) -> None:
        """Drop one use; with none left the segment is free for reuse (the largest free ones beyond
        ``max_cached_bytes`` are unlinked)."""
        with self._lock:
            left = self._holds.get(seg.name, 0) - 1
            if left > 0:
                self._holds[seg.name] = left
                return
            self._holds.pop(seg.name, None)
            if self.closed or seg.name not in self._all:
                return
            self._free.append(seg)
            while sum(s.size for s in self._free) > self.max_cached_bytes and self._free:
                big = max(self._free, key=lambda s: s.size)
                self._free.remove(big)
                self._all.pop(big.name, None)
                big.unlink()

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._all)

    def in_use(self) -> dict[str, int]:
        """Segments not free for reuse, with their users (a call's lease, each tensor viewing it)."""
        with self._lock:
            return dict(self._holds)

    @property
    def lock_name(self) -> str:
        return self._lock_path.name

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            segs = list(self._all.values())
            self._all.clear()
            self._free.clear()
        for seg in segs:
            try:
                seg.unlink()
            except (BufferError, OSError):  # a view still exported: remove the name, memory goes with the process
                seg.path.unlink(missing_ok=True)
        self._lock_path.unlink(missing_ok=True)
        os.close(self._lock_fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
