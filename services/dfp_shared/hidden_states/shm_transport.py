"""Same-node fast path: hidden states through POSIX shared memory, gRPC carrying only handles.

When the trainer and the target share a node (the target as a sidecar sharing a memory-backed
``/dev/shm``), the client creates a segment (a file in the shared directory), names it in the
request, and the server writes every sequence's tensor into it; the reply carries offsets only.

Where segments live: in a private directory ``dfp-shm-<uid>`` under the configured directory,
created with mode 0700 by whichever side comes first and checked by both at start (a real
directory, not a symlink, owned by this user, no group or other access; anything else is refused
with an error naming it). The directory is opened once and every segment, lock file and sweep is
resolved relative to that descriptor, with ``O_NOFOLLOW``: no path component is followed, so a
symlink or a renamed parent cannot redirect a write. The server maps only a regular file owned by
this user, with one link and no group or other access, whose name matches the segment pattern.

Who may name a segment: its creator. Each segment's first page (``HEADER_BYTES``) holds a magic
string and a random 16-byte token written by the client that created it; a request names the
segment and carries the token (``ShmTarget.token``), and the server writes only when the token in
the request equals the one in the file. Another process that can send gRPC requests and guess or
list names, but cannot read the segment (mode 0600 inside a 0700 directory), cannot name it. The
data follows the header, so offsets in replies start at ``HEADER_BYTES``.

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

import contextlib
import errno
import fcntl
import hmac
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import uuid
from pathlib import Path

import torch

from dfp_shared.hidden_states.shm_dir import DIR_PREFIX, PrivateDir, ShmError, segment_dir

__all__ = ["DIR_PREFIX", "PrivateDir", "ShmError", "segment_dir"]  # declared in .shm_dir

log = logging.getLogger(__name__)

DEFAULT_DIR = "/dev/shm"
PREFIX = "dfp-hs"
HEADER_BYTES = 4096  # one page: magic and token; tensors start here
MAGIC = b"DFPSHM01"
TOKEN_BYTES = 16
_SEGMENT_RE = re.compile(rf"{PREFIX}-(?P<owner>[0-9]{{1,10}}-[0-9a-f]{{8}})-(?P<n>[0-9]{{1,12}})\.seg")
_LOCK_RE = re.compile(rf"{PREFIX}-(?P<owner>[0-9]{{1,10}}-[0-9a-f]{{8}})\.lock")
_ALIGN = 1 << 20
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY


class Segment:
    """One mapped segment file (``HEADER_BYTES`` of magic and token, then tensor data).

    A tensor from ``torch.frombuffer`` does not pin the mapping (``mmap.close`` still unmaps it), so a
    copy through the mapping and :meth:`close` take one lock: the server's sweep may drop a dead client's
    segment while a call of that client is still writing into it, and unmapping under the copy would
    crash the server. Closing waits for the copy; a copy after it raises :class:`ShmError`.
    """

    def __init__(self, directory: PrivateDir, name: str, fd: int, size: int, create: bool, token: bytes = b""):
        self.directory = directory
        self.path = directory.path / name
        self.name = name
        self.fd = fd
        self._lock = threading.Lock()
        try:
            if create:
                os.ftruncate(fd, size)
            actual = os.fstat(fd).st_size
            if actual < size:
                raise ShmError(f"shared-memory segment {name} holds {actual} bytes, {size} needed")
            self.size = actual
            self.mm = mmap.mmap(fd, actual)
            if create:
                self.mm[: len(MAGIC) + TOKEN_BYTES] = MAGIC + token
        except BaseException:
            os.close(fd)
            raise
        self.token = token

    @classmethod
    def create(cls, directory: PrivateDir, name: str, size: int) -> Segment:
        """Client side: a new segment file (never an existing name, never through a link) with a fresh token."""
        with directory.fd() as dfd:
            fd = os.open(name, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dfd)
        return cls(directory, name, fd, size, create=True, token=secrets.token_bytes(TOKEN_BYTES))

    @classmethod
    def open_existing(cls, directory: PrivateDir, name: str, size: int) -> Segment:
        """Server side: map a client's segment: a regular file of this user, one link, no group or other access."""
        check_name(name)
        with directory.fd() as dfd:
            try:
                fd = os.open(name, _OPEN_FLAGS, dir_fd=dfd)
            except FileNotFoundError:
                raise ShmError(f"shared-memory segment {name} does not exist in {directory.path} "
                               "(is the shared-memory directory mounted on both sides?)") from None
            except OSError as exc:
                reason = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
                raise ShmError(f"shared-memory segment {name} {reason}; refused") from None
        try:
            st = os.fstat(fd)
            problem = None
            if not stat.S_ISREG(st.st_mode):
                problem = "is not a regular file"
            elif st.st_uid != directory.uid:
                problem = f"is owned by uid {st.st_uid}, not uid {directory.uid}"
            elif st.st_nlink != 1:
                problem = f"has {st.st_nlink} hard links"
            elif st.st_mode & 0o077:
                problem = f"has mode {stat.S_IMODE(st.st_mode):04o}: group or others can reach it"
            elif st.st_size < HEADER_BYTES:
                problem = f"holds {st.st_size} bytes, less than its {HEADER_BYTES}-byte header"
            if problem:
                raise ShmError(f"shared-memory segment {name} {problem}; refused")
        except BaseException:
            os.close(fd)
            raise
        return cls(directory, name, fd, size, create=False)

    def check_token(self, token: bytes) -> None:
        """Refuse a caller whose token is not the one the segment's creator wrote into it."""
        if len(token) != TOKEN_BYTES:
            raise ShmError(f"shm.token: shared-memory segment {self.name} needs the {TOKEN_BYTES}-byte token of the "
                           f"client that created it, got {len(token)} bytes")
        if not hmac.compare_digest(bytes(self.mm[: len(MAGIC) + TOKEN_BYTES]), MAGIC + token):
            raise ShmError(f"shm.token: shared-memory segment {self.name} was not created by this caller "
                           "(token does not match); refused")

    def _check_range(self, offset: int, nbytes: int, what: str) -> None:
        if offset < HEADER_BYTES or offset + nbytes > self.size:
            raise ShmError(f"segment {self.name}: {what} at offset {offset} falls outside its data bytes "
                           f"{HEADER_BYTES}..{self.size}")

    def write(self, offset: int, tensor: torch.Tensor) -> int:
        """Copy a contiguous CPU tensor's bytes to ``offset``; returns the byte count."""
        src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        n = src.numel()
        self._check_range(offset, n, f"{n} bytes")
        if n:
            with self._mapped() as mm:
                torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=offset).copy_(src)
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
        self._check_range(offset, nbytes, "tensor")
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
            self._check_range(offset, nbytes, "tensor")
            with self._mapped() as mm:
                view = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)
                out.view(-1).view(torch.uint8).copy_(view)
                del view
        return out

    @contextlib.contextmanager
    def _mapped(self):
        """The mapping, kept mapped while the block copies through it."""
        with self._lock:
            if self.fd < 0:
                raise ShmError(f"shared-memory segment {self.name} is no longer mapped")
            yield self.mm

    def close(self) -> None:
        with self._lock:
            if self.fd < 0:
                return
            try:
                self.mm.close()
            finally:
                os.close(self.fd)
                self.fd = -1

    def remove_name(self) -> None:
        self.directory.unlink(self.name)

    def unlink(self) -> None:
        self.close()
        self.remove_name()


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _SEGMENT_RE.fullmatch(name):
        raise ShmError(f"invalid shared-memory segment name {name!r} (expected {PREFIX}-<pid>-<8 hex>-<n>.seg)")
    return name


def open_segment(directory: str | Path, name: str, size: int, token: bytes = b"") -> Segment:
    """Server side: map an existing client segment of at least ``size`` bytes whose token is ``token``."""
    check_name(name)
    private = PrivateDir(directory)
    try:
        seg = Segment.open_existing(private, name, size)
    except BaseException:
        private.close()
        raise
    try:
        seg.check_token(token)
    except BaseException:
        seg.close()
        private.close()
        raise
    return seg


class SegmentCache:
    """Server side: mappings of client segments kept across calls (clients reuse their segments).

    Opening the cache creates (mode 0700) and checks the private directory. An entry is dropped when
    its file is gone or was replaced (client closed or died), on use and on :meth:`prune`, so no
    mapping keeps a removed segment's memory alive for long. Every use checks the caller's token.
    """

    def __init__(self, directory: str | Path, max_entries: int = 64):
        self.dir = PrivateDir(directory)
        self.directory = self.dir.path
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[int, Segment]] = {}

    def open(self, name: str, size: int, token: bytes = b"") -> Segment:
        check_name(name)
        st = self.dir.lstat(name)
        if st is None:
            raise ShmError(f"shared-memory segment {name} does not exist in {self.directory} "
                           "(is the shared-memory directory mounted on both sides?)")
        with self._lock:
            entry = self._entries.pop(name, None)
            if entry and entry[0] == st.st_ino and entry[1].size >= size:
                self._entries[name] = entry  # most recently used last
                entry[1].check_token(token)
                return entry[1]
        if entry:
            _close_quietly(entry[1])
        seg = Segment.open_existing(self.dir, name, size)
        try:
            seg.check_token(token)
        except BaseException:
            _close_quietly(seg)
            raise
        with self._lock:
            self._entries[name] = (os.fstat(seg.fd).st_ino, seg)
            while len(self._entries) > self.max_entries:
                _close_quietly(self._entries.pop(next(iter(self._entries)))[1])
        return seg

    def prune(self) -> None:
        with self._lock:
            for name, (inode, seg) in list(self._entries.items()):
                st = self.dir.lstat(name)
                if st is None or st.st_ino != inode:
                    del self._entries[name]
                    _close_quietly(seg)

    def sweep(self) -> list[str]:
        return sweep(self.dir)

    def close(self) -> None:
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for _, seg in entries:
            _close_quietly(seg)
        self.dir.close()


def _close_quietly(seg: Segment) -> None:
    try:
        seg.close()
    except (BufferError, OSError):
        pass


def sweep(directory: str | Path | PrivateDir) -> list[str]:
    """Remove the segments and lock files of owners that are gone; returns the names removed.

    ``directory`` is the configured shared-memory directory (its private directory is swept) or an
    open :class:`PrivateDir`.
    """
    if isinstance(directory, PrivateDir):
        return _sweep(directory)
    if not os.path.isdir(directory):
        return []
    try:
        private = PrivateDir(directory, create=False)
    except FileNotFoundError:
        return []
    try:
        return _sweep(private)
    finally:
        private.close()


def _sweep(private: PrivateDir) -> list[str]:
    removed: list[str] = []
    with private.fd() as dfd:
        names = os.listdir(dfd)
        live: set[str] = set()
        for name in names:
            m = _LOCK_RE.fullmatch(name)
            if not m:
                continue
            owner = m.group("owner")
            try:
                fd = os.open(name, _OPEN_FLAGS, dir_fd=dfd)
            except FileNotFoundError:
                continue
            except OSError:  # not a lock file we made (a link, a directory): leave it and its owner alone
                live.add(owner)
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    live.add(owner)
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    live.add(owner)  # the owner still holds it
                    continue
                for seg in names:  # owner dead: its segments first, then its lock
                    sm = _SEGMENT_RE.fullmatch(seg)
                    if sm and sm.group("owner") == owner:
                        private.unlink(seg)
                        removed.append(seg)
                private.unlink(name)
                removed.append(name)
            finally:
                os.close(fd)
        for name in names:  # segments with no lock file at all are orphans
            sm = _SEGMENT_RE.fullmatch(name)
            if sm and sm.group("owner") not in live and name not in removed:
                if private.lstat(f"{PREFIX}-{sm.group('owner')}.lock") is None:
                    private.unlink(name)
                    removed.append(name)
    if removed:
        log.info("removed shared-memory segments of dead clients", extra={"count": len(removed)})
    return removed


class ShmPool:
    """Client side: segments owned by this process, reused across requests, unlinked on close."""

    def __init__(self, directory: str | Path = DEFAULT_DIR, max_cached_bytes: int = 2 << 30):
        self.dir = PrivateDir(directory)
        self.directory = self.dir.path
        self.owner = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.max_cached_bytes = max_cached_bytes
        self._lock = threading.Lock()
        self._free: list[Segment] = []
        self._all: dict[str, Segment] = {}
        self._holds: dict[str, int] = {}
        self._counter = 0
        final = f"{PREFIX}-{self.owner}.lock"
        tmp = f".{PREFIX}-{self.owner}.lock.tmp"
        try:
            with self.dir.fd() as dfd:
                self._lock_fd = os.open(tmp, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dfd)
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
                os.rename(tmp, final, src_dir_fd=dfd, dst_dir_fd=dfd)  # visible to sweepers only once locked
        except BaseException:
            self.dir.close()
            raise
        self._lock_name = final
        self._lock_path = self.directory / final
        self.closed = False

    def acquire(self, nbytes: int) -> Segment:
        """A segment with at least ``nbytes`` data bytes after its header (the smallest free one that fits,
        else a new one)."""
        need = nbytes + HEADER_BYTES
        with self._lock:
            if self.closed:
                raise ShmError("shared-memory pool is closed")
            fits = [s for s in self._free if s.size >= need]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                self._free.remove(seg)
                self._holds[seg.name] = 1
                return seg
            self._counter += 1
            name = f"{PREFIX}-{self.owner}-{self._counter}.seg"
        size = max(_ALIGN, -(-need // _ALIGN) * _ALIGN)
        seg = Segment.create(self.dir, name, size)
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
        return self._lock_name

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
                seg.remove_name()
        self.dir.unlink(self._lock_name)
        os.close(self._lock_fd)
        self.dir.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
