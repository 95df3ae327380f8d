"""A raw, seekable reader of one S3 object, each read one ranged GET through the store's retries
(:meth:`dfp_shared.storage.store.S3Store.open_read` buffers it)."""

from __future__ import annotations

import io
from typing import Any


class S3RangeReader(io.RawIOBase):
    """A raw, seekable reader of one S3 object: each read is one ranged GET (retried like any other call)."""

    def __init__(self, store: Any, key: str, size: int, url: str):
        super().__init__()
        self.store, self.key, self.size, self.where = store, key, size, url
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        rng = f"bytes={self.pos}-{self.pos + n - 1}"
        data = self.store._call(lambda: self.store.client.get_object(Bucket=self.store.bucket, Key=self.key,
                                                                     Range=rng)["Body"].read(), self.where)
        buf[:len(data)] = data
        self.pos += len(data)
        return len(data)
