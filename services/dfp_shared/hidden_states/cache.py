"""The hidden-state cache: a target's features of every sample of a token dataset, kept in object storage.

A cache is a prefix (``file://`` or ``s3://``) holding

* ``cache.json``: the format, the **key** (the target's fingerprint, the layer ids, the dataset's
  manifest checksum, the dtype, and the hidden size and layer count that follow from the target) and
  the plan of its shards, written once (create-if-absent) when the cache is first opened;
* ``shards/<n>-<token shard>-<part>.safetensors``: each shard covers a run of consecutive samples of
  one token shard (a token shard is cut into parts of at most ``shard_bytes``), with a
  ``hidden_states`` tensor ``(tokens, K*H)`` in the target's dtype, the samples' ``offsets``
  (``samples + 1``, from 0) and the key again in its metadata.

Every shard is written whole and once (create-if-absent: a temporary file linked into place on disk, a
conditional write on S3), so a crash leaves whole shards only and the next run writes just the missing
ones. A key that differs from the cache's is refused with a message naming each difference; features
are never mixed. Reads take single samples (byte ranges of the shard), so each DDP rank reads only its
own samples. This module owns the format, reader and writer together.

A cache prefix is user data: ``cache.json`` is read no further than :data:`MAX_INDEX_BYTES`, and a shard's
safetensors header (an 8-byte length, then JSON) is refused when its length exceeds the file or
:data:`MAX_HEADER_BYTES`, its tensors' byte ranges must lie inside the file and its sample offsets must rise
to the plan's token count, all before anything is allocated for them: a :class:`CacheError` naming the
file and the limit.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import threading
from dataclasses import asdict, dataclass
from pathlib import PurePosixPath

import torch
from safetensors.torch import save as st_save

from dfp_shared.hidden_states.contract import ModelInfo
from dfp_shared.hidden_states.tensor_codec import to_dtype
from dfp_shared.records.token_shards import TokenDataset, read_at_most
from dfp_shared.records.token_shards import _canonical as canonical_safetensors
from dfp_shared.storage.store import NotFound, ObjectStore, open_store

FORMAT = "dflash-hidden-states/1"
INDEX = "cache.json"
DEFAULT_SHARD_BYTES = 256 << 20
_OPEN_READERS = 64
MAX_INDEX_BYTES = 64 << 20  # the plan of every shard (about 150 bytes each)
MAX_HEADER_BYTES = 100_000_000  # a shard's safetensors header (safetensors' own limit); ours take a few hundred


class CacheError(ValueError):
    """A cache cannot be used as asked (missing, incomplete, corrupt, too large); the message says why."""


class CacheMismatch(CacheError):
    """The cache was built for another target, layer set, dataset or dtype."""


def dataset_checksum(manifest: dict) -> str:
    """SHA-256 of a dataset manifest in canonical JSON (it lists every token shard's own checksum)."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class CacheKey:
    """What a cache holds features of; two caches with different keys never share a shard."""

    target_fingerprint: str
    layer_ids: tuple[int, ...]
    dataset_checksum: str
    dtype: str  # a tensor-codec name: the target's dtype
    hidden_size: int
    num_layers: int  # of the target

    NAMES = {"target_fingerprint": "target (fingerprint)", "layer_ids": "layer ids",
             "dataset_checksum": "dataset (manifest checksum)", "dtype": "dtype",
             "hidden_size": "hidden size", "num_layers": "target layer count"}

    @property
    def bytes_per_token(self) -> int:
        """layers x hidden x dtype size."""
        return len(self.layer_ids) * self.hidden_size * to_dtype(self.dtype).itemsize

    def to_dict(self) -> dict:
        return {**asdict(self), "layer_ids": list(self.layer_ids)}

    @classmethod
    def from_dict(cls, data: dict) -> CacheKey:
        try:
            return cls(str(data["target_fingerprint"]), tuple(int(i) for i in data["layer_ids"]),
                       str(data["dataset_checksum"]), str(data["dtype"]), int(data["hidden_size"]),
                       int(data["num_layers"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CacheError(f"unreadable cache key {data!r} ({exc})") from None

    def differences(self, wanted: CacheKey, *, ignore: tuple[str, ...] = ()) -> list[str]:
        """Each field where this (the cache's) key differs from ``wanted`` (the run's), named."""
        out = []
        for name, label in self.NAMES.items():
            mine, theirs = getattr(self, name), getattr(wanted, name)
            if name not in ignore and mine != theirs:
                shown = (lambda v: list(v) if isinstance(v, tuple) else v)
                out.append(f"{label}: the cache has {shown(mine)!r}, this run needs {shown(theirs)!r}")
        return out

    def model_info(self) -> ModelInfo:
        """What the cache serves, as a hidden-state source would describe it."""
        return ModelInfo(model_id="hidden-state cache", fingerprint=self.target_fingerprint,
                         num_layers=self.num_layers, hidden_size=self.hidden_size, vocab_size=0, dtype=self.dtype,
                         layer_ids=list(self.layer_ids), max_tokens_per_request=0)


@dataclass(frozen=True)
class ShardPlan:
    """One cache shard: ``count`` consecutive samples from ``first`` (dataset order) of one token shard."""

    key: str
    token_shard: str
    first: int
    count: int
    tokens: int


def plan_shards(dataset: TokenDataset, bytes_per_token: int, shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[ShardPlan]:
    """The cache's shards: each token shard (in manifest order) cut into runs of samples of at most
    ``shard_bytes`` of features (at least one sample each)."""
    lengths = dataset.lengths.tolist()
    plans, first = [], 0
    for n, entry in enumerate(dataset.manifest.get("shards", [])):
        stem = PurePosixPath(entry["key"]).stem
        end, part, start, size = first + int(entry["num_samples"]), 0, first, 0
        for i in range(first, end):
            row = lengths[i] * bytes_per_token
            if i > start and size + row > shard_bytes:
                plans.append(ShardPlan(f"shards/{n:05d}-{stem}-{part:04d}.safetensors", entry["key"], start,
                                       i - start, sum(lengths[start:i])))
                part, start, size = part + 1, i, 0
            size += row
        if end > start:
            plans.append(ShardPlan(f"shards/{n:05d}-{stem}-{part:04d}.safetensors", entry["key"], start, end - start,
                                   sum(lengths[start:end])))
        first = end
    if first != dataset.num_samples:
        raise CacheError(f"the dataset manifest lists {first} samples but the dataset holds {dataset.num_samples}")
    return plans


def estimate_bytes(dataset: TokenDataset, key: CacheKey) -> int:
    """The whole cache's size: every token of the dataset x bytes per token."""
    return int(dataset.lengths.sum()) * key.bytes_per_token


class HiddenStateCache:
    """One cache prefix, opened for a key: which shards are missing, writing one, reading samples."""

    def __init__(self, store: ObjectStore, key: CacheKey, shards: list[ShardPlan], uri: str = ""):
        self.store, self.key, self.shards = store, key, shards
        self.uri = uri.rstrip("/") or store.url(INDEX).rsplit("/", 1)[0]
        self._starts = torch.tensor([p.first for p in shards], dtype=torch.int64)
        self._readers: collections.OrderedDict[str, _ShardReader] = collections.OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def open(cls, uri: str, key: CacheKey, dataset: TokenDataset, *, create: bool = True,
             shard_bytes: int = DEFAULT_SHARD_BYTES, endpoint_url: str | None = None,
             ignore: tuple[str, ...] = ()) -> HiddenStateCache:
        """The cache at ``uri`` for ``key`` (created when absent and ``create``); raises :class:`CacheMismatch`
        naming every field where the cache's key differs (``ignore``: fields not checked, taken from the
        cache), :class:`CacheError` when there is none and ``create`` is false."""
        store = open_store(uri, endpoint_url=endpoint_url)
        try:
            index = json.loads(read_at_most(store, INDEX, MAX_INDEX_BYTES, CacheError, "a cache index"))
        except NotFound:
            if not create:
                raise CacheError(f"{uri}: no hidden-state cache here (fill it with a `cache` job, or train with "
                                 "hidden_states 'cache')") from None
            index = {"format": FORMAT, "key": key.to_dict(),
                     "shards": [asdict(p) for p in plan_shards(dataset, key.bytes_per_token, shard_bytes)]}
            if not store.put_if_absent(INDEX, json.dumps(index, indent=1).encode()):
                index = json.loads(store.get(INDEX))  # another rank or job created it first
        except CacheError:
            raise
        except (ValueError, RecursionError) as exc:
            raise CacheError(f"{store.url(INDEX)}: unreadable ({type(exc).__name__}: {exc})") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            found = index.get("format") if isinstance(index, dict) else type(index).__name__
            raise CacheError(f"{store.url(INDEX)}: format {found!r}, expected {FORMAT!r}")
        found = CacheKey.from_dict(index.get("key") or {})
        diffs = found.differences(key, ignore=ignore)
        if diffs:
            raise CacheMismatch(f"{uri}: the hidden-state cache was built for another " + "; another ".join(diffs)
                                + ". Its features are never mixed with others: use another hidden_state_cache prefix")
        try:
            shards = [ShardPlan(**p) for p in index.get("shards", [])]
            if not all(isinstance(v, int) and v >= 0 for p in shards for v in (p.first, p.count, p.tokens)):
                raise TypeError("first, count and tokens must be whole numbers")
        except TypeError as exc:
            raise CacheError(f"{store.url(INDEX)}: a shard's plan is malformed ({exc})") from None
        if sum(p.count for p in shards) != dataset.num_samples:
            raise CacheError(f"{store.url(INDEX)}: plans {sum(p.count for p in shards)} samples, the dataset has "
                             f"{dataset.num_samples}")
        return cls(store, found, shards, uri)

    # what is there

    def present(self) -> set[str]:
        return set(self.store.list("shards/"))

    def missing(self) -> list[ShardPlan]:
        have = self.present()
        return [p for p in self.shards if p.key not in have]

    def size_bytes(self) -> int:
        """The features' size when complete (bytes per token x tokens)."""
        return sum(p.tokens for p in self.shards) * self.key.bytes_per_token

    def counts(self) -> dict:
        """``cached_shards``, ``missing_shards`` and ``cache_bytes`` (the features of the cached shards)."""
        have = self.present()
        cached = [p for p in self.shards if p.key in have]
        return {"cached_shards": len(cached), "missing_shards": len(self.shards) - len(cached),
                "cache_bytes": sum(p.tokens for p in cached) * self.key.bytes_per_token}

    # writing

    def encode(self, plan: ShardPlan, states: list[torch.Tensor]) -> bytes:
        """One shard's file from its samples' ``(len_i, K*H)`` features (checked against the plan and key)."""
        dtype, width = to_dtype(self.key.dtype), len(self.key.layer_ids) * self.key.hidden_size
        if len(states) != plan.count:
            raise CacheError(f"{plan.key}: {len(states)} samples' features for {plan.count} samples")
        lengths = [int(s.shape[0]) for s in states]
        for i, s in enumerate(states):
            if s.dtype != dtype or s.dim() != 2 or s.shape[1] != width:
                raise CacheError(f"{plan.key}: sample {plan.first + i} has features {tuple(s.shape)} {s.dtype}, "
                                 f"expected (tokens, {width}) {dtype}")
        if sum(lengths) != plan.tokens:
            raise CacheError(f"{plan.key}: {sum(lengths)} rows of features for {plan.tokens} tokens")
        offsets = torch.zeros(len(states) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
        flat = torch.cat(states) if states else torch.zeros(0, width, dtype=dtype)
        meta = {"format": FORMAT, "key": json.dumps(self.key.to_dict(), sort_keys=True),
                "token_shard": plan.token_shard, "first": str(plan.first), "count": str(plan.count)}
        # header keys sorted: the same shard is the same bytes whichever process writes it
        return canonical_safetensors(st_save({"hidden_states": flat.contiguous(), "offsets": offsets}, metadata=meta))

    def write(self, plan: ShardPlan, states: list[torch.Tensor]) -> int:
        """Write one shard whole, unless it exists already; returns the bytes written (0: it was there)."""
        data = self.encode(plan, states)
        return len(data) if self.store.put_if_absent(plan.key, data) else 0

    # reading

    def locate(self, sample: int) -> ShardPlan:
        at = int(torch.searchsorted(self._starts, torch.tensor(sample), right=True)) - 1
        if at < 0 or not self.shards[at].first <= sample < self.shards[at].first + self.shards[at].count:
            raise CacheError(f"sample {sample} is not in the cache's plan")
        return self.shards[at]

    def has(self, plan: ShardPlan) -> bool:
        return plan.key in self._readers or self.store.exists(plan.key)

    def read(self, sample: int, length: int | None = None) -> torch.Tensor:
        """The first ``length`` rows (all: None) of one sample's features, ``(length, K*H)``."""
        plan = self.locate(sample)
        with self._lock:
            reader = self._reader(plan)
            return reader.read(sample - plan.first, length)

    def _reader(self, plan: ShardPlan) -> _ShardReader:
        reader = self._readers.get(plan.key)
        if reader is None:
            reader = _ShardReader(self.store, plan, self.key)
            self._readers[plan.key] = reader
            while len(self._readers) > _OPEN_READERS:
                self._readers.popitem(last=False)[1].close()
        self._readers.move_to_end(plan.key)
        return reader

    def close(self) -> None:
        with self._lock:
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()


class _ShardReader:
    """Byte-range reads of single samples from one shard file (its header parsed once, bounded: see the module)."""

    def __init__(self, store: ObjectStore, plan: ShardPlan, key: CacheKey):
        self.url = store.url(plan.key)
        try:
            self.fh = store.open_read(plan.key)
        except NotFound:
            raise CacheError(f"{self.url}: the shard is missing from the cache") from None
        try:
            self._open(plan, key)
        except BaseException:
            self.fh.close()
            raise

    def _open(self, plan: ShardPlan, key: CacheKey) -> None:
        size = self.fh.seek(0, io.SEEK_END)
        self.fh.seek(0)
        n = int.from_bytes(self._read(8), "little")
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise CacheError(f"{self.url}: the safetensors header claims {n:,} bytes; the file holds {size:,} and a "
                             f"header may take at most {MAX_HEADER_BYTES:,}; refused")
        try:
            header = json.loads(self._read(n))
            meta = header.pop("__metadata__", {}) or {}
            ours = meta.get("format") == FORMAT and json.loads(meta.get("key", "{}")) == json.loads(
                json.dumps(key.to_dict(), sort_keys=True))
        except (ValueError, RecursionError, AttributeError, TypeError) as exc:
            raise CacheError(f"{self.url}: unreadable safetensors header ({type(exc).__name__})") from None
        if not ours:
            raise CacheMismatch(f"{self.url}: the shard was written for another cache key; refused")
        width = len(key.layer_ids) * key.hidden_size
        self.dtype, self.width = to_dtype(key.dtype), width
        self.row_bytes = width * self.dtype.itemsize
        base = 8 + n
        states = self._span(header, "hidden_states", [plan.tokens, width], plan.tokens * self.row_bytes, size - base)
        offsets = self._span(header, "offsets", [plan.count + 1], 8 * (plan.count + 1), size - base)
        self.fh.seek(base + offsets[0])
        self.offsets = torch.frombuffer(bytearray(self._read(8 * (plan.count + 1))), dtype=torch.int64)
        if int(self.offsets[0]) != 0 or int(self.offsets[-1]) != plan.tokens or bool(
                (self.offsets[1:] < self.offsets[:-1]).any()):
            raise CacheError(f"{self.url}: sample offsets must rise from 0 to the plan's {plan.tokens} tokens; refused")
        self.base = base + states[0]

    def _span(self, header: dict, name: str, shape: list[int], nbytes: int, room: int) -> tuple[int, int]:
        """A tensor's byte range in the data section, checked against its expected shape and the file's size."""
        entry = header.get(name)
        span = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(entry, dict) or entry.get("shape") != shape or not isinstance(span, list) or len(span) != 2
                or not all(isinstance(v, int) for v in span) or not 0 <= span[0] <= span[1] <= room
                or span[1] - span[0] != nbytes):
            raise CacheError(f"{self.url}: tensor {name!r} is {str(entry)[:200]}; the plan needs shape {shape} ({nbytes:,} "
                             f"bytes) inside the file's {room:,} data bytes")
        return span[0], span[1]

    def _read(self, n: int) -> bytes:
        data = self.fh.read(n)
        if len(data) != n:
            raise CacheError(f"{self.url}: truncated ({len(data)} of {n} bytes)")
        return data

    def read(self, local: int, length: int | None) -> torch.Tensor:
        start, end = int(self.offsets[local]), int(self.offsets[local + 1])
        rows = end - start if length is None else min(int(length), end - start)
        if length is not None and length > end - start:
            raise CacheError(f"{self.url}: sample {local} has {end - start} tokens of features, {length} asked")
        if rows == 0:
            return torch.zeros(0, self.width, dtype=self.dtype)
        self.fh.seek(self.base + start * self.row_bytes)
        return torch.frombuffer(bytearray(self._read(rows * self.row_bytes)), dtype=self.dtype).view(rows, self.width)

    def close(self) -> None:
        self.fh.close()
