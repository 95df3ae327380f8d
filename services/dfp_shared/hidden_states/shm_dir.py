"""The private segment directory of the shared-memory transport (:mod:`.shm_transport`): ``dfp-shm-<uid>`` under
the configured directory, created with mode 0700 by whichever side comes first and checked by both at start (a
real directory, not a symlink, owned by this user, no group or other access), opened once; every name is
resolved relative to its descriptor."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from pathlib import Path

DIR_PREFIX = "dfp-shm"


class ShmError(ValueError):
    pass


def segment_dir(directory: str | Path) -> Path:
    """The private directory under the configured ``directory`` where this user's segments live."""
    return Path(directory) / f"{DIR_PREFIX}-{os.geteuid()}"


class PrivateDir:
    """The private segment directory, opened once; every name is resolved relative to its descriptor."""

    def __init__(self, directory: str | Path, create: bool = True):
        self.base = Path(directory)
        self.path = segment_dir(self.base)
        self.uid = os.geteuid()
        self._lock = threading.RLock()
        try:
            parent = os.open(self.base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise ShmError(f"shared-memory directory {self.base} does not exist") from None
        try:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(self.path.name, 0o700, dir_fd=parent)
            try:
                fd = os.open(self.path.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=parent)
            except FileNotFoundError:
                raise  # only when not asked to create it
            except OSError as exc:
                kind = "a symbolic link" if _is_symlink(self.path.name, parent) else "not a directory"
                raise ShmError(f"shared-memory directory {self.path} is {kind} ({exc.strerror}); refusing to use "
                               "it: remove it so a private one (mode 0700) is created") from None
        finally:
            os.close(parent)
        try:
            st = os.fstat(fd)
            problem = None
            if st.st_uid != self.uid:
                problem = f"is owned by uid {st.st_uid}, not by this user (uid {self.uid})"
            elif st.st_mode & 0o077:
                problem = f"has mode {stat.S_IMODE(st.st_mode):04o}: group or others can reach it"
            if problem:
                raise ShmError(f"shared-memory directory {self.path} {problem}; it must be owned by uid {self.uid} "
                               "with mode 0700 (remove it or fix it with chmod 700)")
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    @contextlib.contextmanager
    def fd(self):
        """The directory descriptor, held open while the block runs (a closed directory raises ShmError)."""
        with self._lock:
            if self._fd < 0:
                raise ShmError(f"shared-memory directory {self.path} is closed")
            yield self._fd

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def unlink(self, name: str) -> None:
        with self.fd() as dfd, contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dfd)

    def lstat(self, name: str) -> os.stat_result | None:
        with self.fd() as dfd:
            try:
                return os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                return None

    def listdir(self) -> list[str]:
        with self.fd() as dfd:
            return os.listdir(dfd)


def _is_symlink(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
