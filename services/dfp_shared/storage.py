"""Object storage: one interface over ``file://`` directories and ``s3://`` buckets.

Keys are ``/``-separated paths relative to the store's root. ``open_store(uri)`` returns a store
rooted at a URI; ``split_uri(uri)`` splits a full object URI into (store URI, key).
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

log = logging.getLogger(__name__)

DEFAULT_WORKERS = 32
MULTIPART_THRESHOLD = 64 * 1024 * 1024


class StorageError(Exception):
    """A storage operation failed for a reason the caller should see (not transient)."""


class NotFound(StorageError, FileNotFoundError):
    """The key (or bucket) does not exist."""


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


def join_key(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


class ObjectStore(ABC):
    """Common interface; subclasses implement the single-object primitives."""

    uri: str

    @abstractmethod
    def list(self, prefix: str = "", page_size: int = 1000) -> Iterator[str]:
        """Keys under ``prefix`` in lexical order (paginated underneath)."""

    @abstractmethod
    def get(self, key: str) -> bytes: ...

    @abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def get_file(self, key: str, dest: str | os.PathLike) -> Path:
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
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
            raise StorageError(f"invalid key {key!r}: escapes the store root")
        return path

    def list(self, prefix: str = "", page_size: int = 1000) -> Iterator[str]:
        base = self.root
        out = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".tmp-")]
            for name in filenames:
                if name.startswith(".tmp-"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), base).replace(os.sep, "/")
                if rel.startswith(prefix):
                    out.append(rel)
        yield from sorted(out)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
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

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
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

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


def _retry(fn: Callable, what: str, attempts: int = 5, base_delay: float = 0.2):
    """Call ``fn`` with exponential backoff and jitter on transient S3/network errors."""
    from botocore.exceptions import BotoCoreError, ClientError
    from botocore.exceptions import ConnectionError as BotoConnError

    for attempt in range(attempts):
        try:
            return fn()
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in ("NoSuchKey", "404", "NotFound"):
                raise NotFound(f"{what}: no such object") from None
            if code == "NoSuchBucket":
                raise NotFound(f"{what}: bucket does not exist") from None
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
                raise StorageError(f"{what}: access denied ({code}); check the S3 credentials") from None
            transient = status >= 500 or code in ("SlowDown", "RequestTimeout", "Throttling", "InternalError")
            if not transient or attempt == attempts - 1:
                raise StorageError(f"{what}: {code or status}: {exc.response.get('Error', {}).get('Message', '')}") from None
        except (BotoConnError, BotoCoreError) as exc:
            if "credentials" in str(exc).lower():
                raise StorageError(f"{what}: no S3 credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a role)") from None
            if attempt == attempts - 1:
                raise StorageError(f"{what}: {type(exc).__name__}: {exc}") from None
        delay = base_delay * (2**attempt) * (0.5 + random.random())
        log.warning("transient storage error, retrying", extra={"what": what, "attempt": attempt + 1, "delay_s": round(delay, 3)})
        time.sleep(delay)
    raise AssertionError("unreachable")


class S3Store(ObjectStore):
    """An S3 bucket (and optional prefix) through boto3; any S3-compatible endpoint."""

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None, region: str = "us-east-1",
                 max_pool_connections: int = 64):
        import boto3
        from botocore.config import Config

        if not bucket:
            raise StorageError("s3 URI has no bucket name")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        session = boto3.session.Session()
        self.client = session.client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            config=Config(max_pool_connections=max_pool_connections, retries={"max_attempts": 3, "mode": "standard"},
                          connect_timeout=10, read_timeout=60),
        )
        from boto3.s3.transfer import TransferConfig

        self.transfer = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=16 * 1024 * 1024,
                                       max_concurrency=8)

    def _key(self, key: str) -> str:
        return join_key(self.prefix, normalize_key(key))

    def list(self, prefix: str = "", page_size: int = 1000) -> Iterator[str]:
        full = join_key(self.prefix, prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        if prefix.endswith("/") and not full.endswith("/"):
            full += "/"
        token = None
        strip = len(self.prefix) + 1 if self.prefix else 0
        while True:
            kwargs = {"Bucket": self.bucket, "Prefix": full, "MaxKeys": page_size}
            if token:
                kwargs["ContinuationToken"] = token
            page = _retry(lambda kw=kwargs: self.client.list_objects_v2(**kw), f"list {self.uri}/{prefix}")
            for obj in page.get("Contents", []):
                yield obj["Key"][strip:]
            if not page.get("IsTruncated"):
                return
            token = page["NextContinuationToken"]

    def get(self, key: str) -> bytes:
        k = self._key(key)
        return _retry(lambda: self.client.get_object(Bucket=self.bucket, Key=k)["Body"].read(), self.url(key))

    def get_file(self, key: str, dest: str | os.PathLike) -> Path:
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = str(dest) + ".part"
        _retry(lambda: self.client.download_file(self.bucket, self._key(key), tmp, Config=self.transfer), self.url(key))
        os.replace(tmp, dest)
        return dest

    def put(self, key: str, data: bytes) -> None:
        k = self._key(key)
        if len(data) >= MULTIPART_THRESHOLD:
            import io

            _retry(lambda: self.client.upload_fileobj(io.BytesIO(data), self.bucket, k, Config=self.transfer), self.url(key))
        else:
            _retry(lambda: self.client.put_object(Bucket=self.bucket, Key=k, Body=data), self.url(key))

    def put_file(self, key: str, src: str | os.PathLike) -> None:
        _retry(lambda: self.client.upload_file(str(src), self.bucket, self._key(key), Config=self.transfer), self.url(key))

    def exists(self, key: str) -> bool:
        try:
            _retry(lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key)), self.url(key))
            return True
        except NotFound:
            return False

    def delete(self, key: str) -> None:
        _retry(lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(key)), self.url(key))

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
    """Split an object URI into (root URI, key): ``s3://b/a/c.json`` -> (``s3://b``, ``a/c.json``)."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        return f"s3://{parsed.netloc}", normalize_key(parsed.path.lstrip("/"))
    path = Path(uri[len("file://"):] if uri.startswith("file://") else uri).resolve()
    return "file://" + str(path.parent), path.name


def check_uri(uri: str, allowed_schemes: tuple[str, ...] = ("file", "s3")) -> str:
    """Validate a user-given storage URI: allowed scheme, no ``..`` segment. Returns it unchanged."""
    parsed = urlparse(uri)
    scheme = parsed.scheme or "file"
    if scheme not in allowed_schemes:
        raise StorageError(f"URI scheme {scheme!r} not allowed (allowed: {', '.join(allowed_schemes)})")
    path = parsed.path if parsed.scheme else uri
    if any(part == ".." for part in path.split("/")):
        raise StorageError(f"URI {uri!r} contains a '..' segment")
    if scheme == "s3" and not parsed.netloc:
        raise StorageError(f"URI {uri!r} has no bucket")
    return uri
