"""Object storage: one interface over ``file://`` directories and ``s3://`` buckets.

Keys are ``/``-separated paths relative to the store's root. ``open_store(uri)`` returns a store
rooted at a URI; ``split_uri(uri)`` splits a full object URI into (store URI, key).
"""

from __future__ import annotations

import io
import logging
import os
import random
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from dfp_shared.storage.errors import AccessRefused, NotFound, StorageError
from dfp_shared.storage.retry import RETRY_ATTEMPTS, _retry
from dfp_shared.storage.s3_range_reader import S3RangeReader

log = logging.getLogger(__name__)
__all__ = ["AccessRefused", "NotFound", "StorageError", "ObjectStore", "LocalStore", "S3Store", "open_store",
           "split_uri", "visible", "normalize_key", "join_key", "local_dir_confined"]

DEFAULT_WORKERS = 32
MULTIPART_THRESHOLD = 64 * 1024 * 1024  # objects this large go up and down in parts
MULTIPART_CHUNKSIZE = 16 * 1024 * 1024
MIN_PART_SIZE = 5 * 1024 * 1024  # S3 rejects smaller parts (but the last)
RANGE_READ_SIZE = 8 * 1024 * 1024  # one ranged GET of a streamed object
CLIENT_RETRIES = 3  # the boto3 client tries each request once more than this


def normalize_key(key: str) -> str:
    """Validate a key: relative, no ``..``, no empty parts. Returns it without a leading ``./``."""
    if not isinstance(key, str) or not key:
        raise StorageError(f"invalid key {key!r}: empty")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise StorageError(f"invalid key {key!r}: must be a relative '/'-separated path")
    parts = [p for p in PurePosixPath(key).parts if p != "."]
    if any(p == ".." for p in parts) or not parts:
        raise StorageError(f"invalid key {key!r}: '..' would escape the store root")
    return "/".join(parts)


def _partial_path(dest: Path) -> Path:
    """Where a download is written before its atomic rename: one per writer, so concurrent ones never collide."""
    return dest.with_name(f".{dest.name}.{os.getpid()}-{random.getrandbits(48):012x}.part")


def join_key(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class ObjectStore(ABC):
    """Common interface; subclasses implement the single-object primitives."""

    uri: str

    @abstractmethod
    def list(self, prefix: str = "", page_size: int = 1000) -> Iterator[str]:
        """Keys that start with ``prefix`` (a plain string, not a directory), lazily, in lexical order."""

    @abstractmethod
    def get(self, key: str) -> bytes: ...

    @abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create the object only if no object has that key (atomically); False if one already exists."""

    def open_read(self, key: str) -> io.BufferedIOBase:
        """A seekable binary stream over one object, read as it is consumed (the caller closes it).

        This base version holds the object in memory; the stores below read it piece by piece.
        """
        return io.BytesIO(self.get(key))

    def get_file(self, key: str, dest: str | os.PathLike) -> Path:
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = _partial_path(dest)
        tmp.write_bytes(self.get(key))
        os.replace(tmp, dest)
        return dest

    def put_file(self, key: str, src: str | os.PathLike) -> None:
        self.put(key, Path(src).read_bytes())

    def url(self, key: str) -> str:
        return self.uri.rstrip("/") + "/" + normalize_key(key)

    # many-object operations on a bounded thread pool

    def get_many(self, keys: Iterable[str], max_workers: int = DEFAULT_WORKERS) -> Iterator[tuple[str, bytes]]:
        """Download many objects in parallel; yields ``(key, data)`` in input order."""
        keys = list(keys)
        with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(keys) or 1))) as pool:
            yield from zip(keys, pool.map(self.get, keys))

    def download_many(self, keys: Iterable[str], dest_dir: str | os.PathLike, max_workers: int = DEFAULT_WORKERS) -> list[Path]:
        """Download many objects into ``dest_dir`` (keeping key paths) in parallel."""
        dest_dir = Path(dest_dir)
        keys = list(keys)
        with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(keys) or 1))) as pool:
            return list(pool.map(lambda k: self.get_file(k, dest_dir / normalize_key(k)), keys))

    def put_many(self, items: Iterable[tuple[str, bytes]], max_workers: int = DEFAULT_WORKERS) -> int:
        """Upload many ``(key, data)`` pairs in parallel; returns the count."""
        items = list(items)
        with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(items) or 1))) as pool:
            list(pool.map(lambda kv: self.put(*kv), items))
        return len(items)


class LocalStore(ObjectStore):
    """A directory as an object store; writes are atomic (temp file + rename)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.uri = "file://" + str(self.root)

    def _path(self, key: str) -> Path:
        path = (self.root / normalize_key(key)).resolve()
        if path != self.root and self.root not in path.parents:
            raise AccessRefused(f"{self.uri}/{key}: leads out of the store (a symlink?); refused")
        return path

    def list(self, prefix: str = "", page_size: int = 1000) -> Iterator[str]:
        """Walks only the directory the prefix names up to its last ``/``, one sorted directory at a time.

        Memory grows with the largest directory, not the tree. Symlinks (to files or directories) are
        not listed or followed. ``page_size`` is validated as for S3 but a local walk needs no pages.
        """
        _check_page_size(page_size)
        head, _, name_prefix = prefix.rpartition("/")
        parts = head.split("/") if head else []
        if any(p in ("", ".", "..") for p in parts) or "\\" in prefix or "\x00" in prefix:
            return  # keys are normalized: none starts with such a prefix
        top = self.root.joinpath(*parts)
        if top.resolve() != top:
            return  # the prefix runs through a symlink
        yield from self._walk(top, head + "/" if head else "", name_prefix)

    def _walk(self, directory: str | os.PathLike, rel: str, name_prefix: str = "") -> Iterator[str]:
        try:
            with os.scandir(directory) as it:
                # a directory sorts as "name/": every key below it starts so, which keeps S3's order
                entries = sorted((e.name + "/" if e.is_dir(follow_symlinks=False) else e.name, e) for e in it
                                 if e.name.startswith(name_prefix) and not e.name.startswith(".tmp-"))
        except (FileNotFoundError, NotADirectoryError):
            return
        for name, entry in entries:
            if name.endswith("/"):
                yield from self._walk(entry.path, rel + name)
            elif entry.is_file(follow_symlinks=False):
                yield rel + name

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            raise NotFound(f"{self.url(key)}: no such object") from None

    def open_read(self, key: str) -> io.BufferedIOBase:
        path = self._path(key)
        try:
            if not path.is_file():
                raise FileNotFoundError(path)
            return open(path, "rb")  # noqa: SIM115 - the caller closes it
        except (FileNotFoundError, IsADirectoryError):
            raise NotFound(f"{self.url(key)}: no such object") from None

    def get_file(self, key: str, dest: str | os.PathLike) -> Path:
        import shutil

        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        src = self._path(key)
        if not src.is_file():
            raise NotFound(f"{self.url(key)}: no such object")
        shutil.copyfile(src, dest)
        return dest

    @staticmethod
    def _temp_beside(path: Path, data: bytes) -> str:
        """A complete temporary file holding ``data`` in ``path``'s directory (hidden from listings)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return tmp

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._temp_beside(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put_file(self, key: str, src: str | os.PathLike) -> None:
        import shutil

        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        os.close(fd)
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        tmp = self._temp_beside(path, data)
        try:
            os.link(tmp, path)  # fails if the key exists: complete content or nothing
            return True
        except FileExistsError:
            return False
        finally:
            Path(tmp).unlink(missing_ok=True)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


def local_dir_confined(path: str | os.PathLike, uri: str) -> Path:
    """``path`` if every entry below it is a regular file or directory inside it; raises AccessRefused
    naming the first link out of it (or FIFO, socket, device). A model or tokenizer directory is read by
    libraries that follow links, so one whose files lead elsewhere is not read at all."""
    root = Path(os.path.realpath(path))
    if not root.is_dir():
        raise NotFound(f"{uri}: no such directory")
    for directory, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            entry = Path(directory) / name
            real = Path(os.path.realpath(entry))
            if real != root and root not in real.parents:
                raise AccessRefused(f"{uri}: {entry.relative_to(root)} links out of the directory; refused")
            if not (real.is_file() or real.is_dir()):
                raise AccessRefused(f"{uri}: {entry.relative_to(root)} is not a regular file; refused")
    return root


def _check_page_size(page_size: int) -> None:
    if page_size < 1:
        raise StorageError(f"list page_size must be at least 1, got {page_size}")


class S3Store(ObjectStore):
    """An S3 bucket (and optional prefix) through boto3; any S3-compatible endpoint."""

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None, region: str = "us-east-1",
                 max_pool_connections: int = 64, multipart_threshold: int = MULTIPART_THRESHOLD,
                 multipart_chunksize: int = MULTIPART_CHUNKSIZE, attempts: int = RETRY_ATTEMPTS):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        if not bucket:
            raise StorageError("s3 URI has no bucket name")
        if multipart_chunksize < MIN_PART_SIZE:
            raise StorageError(f"multipart_chunksize must be at least {MIN_PART_SIZE} bytes (S3's smallest part)")
        if attempts < 1:
            raise StorageError(f"attempts must be at least 1, got {attempts}")
        self.bucket = bucket
        self.attempts = attempts
        self._bucket_seen = False  # set once a HEAD of the bucket succeeded
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        session = boto3.session.Session()
        self.client = session.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            config=Config(max_pool_connections=max_pool_connections, retries={"max_attempts": CLIENT_RETRIES, "mode": "standard"},
                          connect_timeout=10, read_timeout=60),
        )
        self.transfer = TransferConfig(multipart_threshold=multipart_threshold, multipart_chunksize=multipart_chunksize,
                                       max_concurrency=8)

    def _key(self, key: str) -> str:
        return join_key(self.prefix, normalize_key(key))

    def _call(self, fn: Callable, what: str):
        return _retry(fn, what, attempts=self.attempts)

    def list(self, prefix: str = "", page_size: int = 1000) -> Iterator[str]:
        _check_page_size(page_size)
        full = join_key(self.prefix, prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        if prefix.endswith("/") and not full.endswith("/"):
            full += "/"
        token = None
        strip = len(self.prefix) + 1 if self.prefix else 0
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": full, "MaxKeys": page_size}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call(lambda kw=kwargs: self.client.list_objects_v2(**kw), f"list {self.uri}/{prefix}")
            for obj in page.get("Contents", []):
                yield obj["Key"][strip:]
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    def get(self, key: str) -> bytes:
        k = self._key(key)
        return self._call(lambda: self.client.get_object(Bucket=self.bucket, Key=k)["Body"].read(), self.url(key))

    def open_read(self, key: str, buffer_size: int = RANGE_READ_SIZE) -> io.BufferedIOBase:
        """Ranged GETs of ``buffer_size`` bytes as the stream is read (seekable: Parquet reads its footer first)."""
        k = self._key(key)
        head = self._call(lambda: self.client.head_object(Bucket=self.bucket, Key=k), self.url(key))
        return io.BufferedReader(S3RangeReader(self, k, int(head["ContentLength"]), self.url(key)), buffer_size)

    def get_file(self, key: str, dest: str | os.PathLike) -> Path:
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = str(_partial_path(dest))
        self._call(lambda: self.client.download_file(self.bucket, self._key(key), tmp, Config=self.transfer), self.url(key))
        os.replace(tmp, dest)
        return dest

    def put(self, key: str, data: bytes) -> None:
        k = self._key(key)
        if len(data) >= self.transfer.multipart_threshold:
            import io

            self._call(lambda: self.client.upload_fileobj(io.BytesIO(data), self.bucket, k, Config=self.transfer), self.url(key))
        else:
            self._call(lambda: self.client.put_object(Bucket=self.bucket, Key=k, Body=data), self.url(key))

    def put_file(self, key: str, src: str | os.PathLike) -> None:
        self._call(lambda: self.client.upload_file(str(src), self.bucket, self._key(key), Config=self.transfer), self.url(key))

    def exists(self, key: str) -> bool:
        try:
            self._call(lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key)), self.url(key))
            return True
        except NotFound:
            self._check_bucket()
            return False

    def _check_bucket(self) -> None:
        """A HEAD answers a bare 404 for a missing key and a missing bucket alike: tell them apart, once."""
        if self._bucket_seen:
            return
        try:
            self._call(lambda: self.client.head_bucket(Bucket=self.bucket), f"s3://{self.bucket}")
        except NotFound:
            raise NotFound(f"s3://{self.bucket}: bucket does not exist") from None
        self._bucket_seen = True

    def put_if_absent(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        k = self._key(key)
        try:  # S3 conditional write: 412 PreconditionFailed when the key exists
            self._call(lambda: self.client.put_object(Bucket=self.bucket, Key=k, Body=data, IfNoneMatch="*"),
                       self.url(key))
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                return False
            raise
        except StorageError as exc:
            if "PreconditionFailed" in str(exc) or "ConditionalRequestConflict" in str(exc):
                return False
            raise

    def delete(self, key: str) -> None:
        self._call(lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(key)), self.url(key))

    def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (tests and the embedded demo)."""
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception:
            self.client.create_bucket(Bucket=self.bucket)


def open_store(uri: str, endpoint_url: str | None = None, region: str = "us-east-1") -> ObjectStore:
    """Open the store rooted at ``uri`` (``file:///dir``, ``file://./rel``, a bare path, or ``s3://bucket/prefix``)."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        path = uri[len("file://"):] if uri.startswith("file://") else uri
        return LocalStore(path or ".")
    if parsed.scheme == "s3":
        return S3Store(parsed.netloc, parsed.path, endpoint_url=endpoint_url or os.environ.get("AWS_ENDPOINT_URL"), region=region)
    raise StorageError(f"unsupported storage URI scheme {parsed.scheme!r} in {uri!r}: use file:// or s3://")


def split_uri(uri: str) -> tuple[str, str]:
    """Split an object URI into (root URI, key): ``s3://b/a/c.json`` -> (``s3://b``, ``a/c.json``).

    Local paths are split as written, never resolved: a symlink stays inside the store that holds it,
    whose own checks refuse a link that leads out of it.
    """
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        return f"s3://{parsed.netloc}", normalize_key(parsed.path.lstrip("/"))
    path = Path(os.path.abspath(uri[len("file://"):] if uri.startswith("file://") else uri))
    return "file://" + str(path.parent), path.name


def visible(keys: Iterable[str]) -> Iterator[str]:
    """Keys with no hidden (``.``-prefixed) segment: job inputs never include hidden files or folders."""
    return (k for k in keys if not any(part.startswith(".") for part in k.split("/")))
