"""Token shards and datasets: the tokenizer's output and the trainer's input.

A shard is a safetensors file with flat ``input_ids`` (int32), ``loss_mask`` (uint8, 1 = trained)
and ``offsets`` (int64, ``num_samples + 1`` sample boundaries starting at 0), plus string metadata
(format, tokenizer and chat-template fingerprints, counts, sample ids, source). A dataset is a
prefix holding ``shards/*.safetensors`` and a ``manifest.json`` listing them with counts and
SHA-256 checksums (the tokenizer also records ``thinking``, the chat template's thinking mode);
:func:`load_dataset` reads every shard once into three concatenated tensors.

A dataset is user data: the manifest is read no further than :data:`MAX_MANIFEST_BYTES` and its fields
checked before use, and a shard's sample boundaries must rise from 0 to its token count, so no count
it claims sizes anything; a violation is a :class:`DatasetError` naming the file and the limit.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT = "dflash-tokens/1"
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # a manifest lists its shards (about 200 bytes each), not samples


class DatasetError(ValueError):
    """A shard or manifest is missing, corrupt or inconsistent; the message names it."""


@dataclass
class FlatSamples:
    """Samples stored flat: all tokens and masks concatenated, and the sample boundaries."""

    input_ids: torch.Tensor  # (N,) int32
    loss_mask: torch.Tensor  # (N,) uint8
    offsets: torch.Tensor  # (S+1,) int64
    sample_ids: list[str]

    @property
    def num_samples(self) -> int:
        return len(self.offsets) - 1


@dataclass
class Shard(FlatSamples):
    metadata: dict = field(default_factory=dict)

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[a:b], self.loss_mask[a:b]


def encode_shard(sample_ids: Sequence[str], token_lists: Sequence[Sequence[int]], mask_lists: Sequence[Sequence[int]],
                 metadata: dict | None = None) -> bytes:
    """Serialise samples into one shard. ``metadata`` values are stored as strings (JSON for non-strings)."""
    if not (len(sample_ids) == len(token_lists) == len(mask_lists)):
        raise ValueError("sample_ids, token_lists and mask_lists differ in length")
    lengths = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
    for sid, toks, mask in zip(sample_ids, token_lists, mask_lists):
        if len(toks) != len(mask):
            raise ValueError(f"sample {sid!r}: {len(toks)} tokens but {len(mask)} mask entries")
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = _flat(token_lists, np.int32)
    mask = _flat(mask_lists, np.uint8)
    meta = {"format": FORMAT, "num_samples": str(len(sample_ids)), "num_tokens": str(int(offsets[-1])),
            "num_trained_tokens": str(int(mask.sum(dtype=np.int64))), "sample_ids": json.dumps(list(sample_ids))}
    for k, v in (metadata or {}).items():
        meta[k] = v if isinstance(v, str) else json.dumps(v)
    return _canonical(st_save({"input_ids": torch.from_numpy(ids), "loss_mask": torch.from_numpy(mask),
                               "offsets": torch.from_numpy(offsets)}, metadata=meta))


def _flat(lists: Sequence[Sequence[int]], dtype) -> np.ndarray:
    """Concatenate per-sample lists or arrays (no per-token Python loop)."""
    if not lists:
        return np.zeros(0, dtype=dtype)
    return np.concatenate([np.asarray(x, dtype=dtype).reshape(-1) for x in lists])


def _canonical(data: bytes) -> bytes:
    """The same safetensors file with its JSON header keys sorted: safetensors writes the metadata in
    hash-map order, which differs between processes, and a redelivered task must write identical bytes."""
    n = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8:8 + n]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data[8 + n:]


def _metadata(data: bytes) -> dict:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]).get("__metadata__", {})


def decode_shard(data: bytes, name: str = "<shard>") -> Shard:
    """Parse a shard, checking its format and internal consistency."""
    try:
        tensors = st_load(data)
        meta = _metadata(data)
    except Exception as exc:  # noqa: BLE001 - corrupt file
        raise DatasetError(f"{name}: not a readable safetensors shard ({exc})") from None
    if meta.get("format") != FORMAT:
        raise DatasetError(f"{name}: format {meta.get('format')!r}, expected {FORMAT!r}")
    missing = {"input_ids", "loss_mask", "offsets"} - set(tensors)
    if missing:
        raise DatasetError(f"{name}: missing tensors {sorted(missing)}")
    ids, mask, offsets = tensors["input_ids"], tensors["loss_mask"], tensors["offsets"]
    if ids.shape != mask.shape or offsets.numel() < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel():
        raise DatasetError(f"{name}: inconsistent tensors (input_ids {tuple(ids.shape)}, loss_mask {tuple(mask.shape)}, "
                           f"offsets ending at {int(offsets[-1]) if offsets.numel() else None})")
    if ids.dim() != 1 or offsets.dim() != 1 or bool((offsets[1:] < offsets[:-1]).any()):
        raise DatasetError(f"{name}: offsets must rise from 0 to the {ids.numel()} tokens of flat input_ids; "
                           "a sample boundary goes back or past the end")
    sample_ids = json.loads(meta.get("sample_ids", "[]"))
    if len(sample_ids) != offsets.numel() - 1:
        raise DatasetError(f"{name}: {len(sample_ids)} sample ids for {offsets.numel() - 1} samples")
    return Shard(ids, mask, offsets, sample_ids, meta)


def shard_entry(key: str, data: bytes) -> dict:
    """The manifest entry of a shard already encoded as ``data``."""
    meta = _metadata(data)
    return {"key": key, "num_samples": int(meta["num_samples"]), "num_tokens": int(meta["num_tokens"]),
            "num_trained_tokens": int(meta["num_trained_tokens"]), "sha256": hashlib.sha256(data).hexdigest(),
            "tokenizer_fingerprint": meta.get("tokenizer_fingerprint"),
            "chat_template_fingerprint": meta.get("chat_template_fingerprint")}


def build_manifest(entries: list[dict], *, extra: dict | None = None) -> dict:
    """A dataset manifest from shard entries (see :func:`shard_entry`); fingerprints must agree."""
    entries = sorted(entries, key=lambda e: e["key"])
    fps = {(e.get("tokenizer_fingerprint"), e.get("chat_template_fingerprint")) for e in entries}
    if len(fps) > 1:
        raise DatasetError(f"shards were tokenized with different tokenizers or templates: {sorted(map(str, fps))}")
    tok_fp, tpl_fp = next(iter(fps)) if fps else (None, None)
    return {"format": FORMAT, "tokenizer_fingerprint": tok_fp, "chat_template_fingerprint": tpl_fp,
            "num_samples": sum(e["num_samples"] for e in entries), "num_tokens": sum(e["num_tokens"] for e in entries),
            "num_trained_tokens": sum(e["num_trained_tokens"] for e in entries),
            "shards": [{k: e[k] for k in ("key", "num_samples", "num_tokens", "num_trained_tokens", "sha256")}
                       for e in entries], **(extra or {})}


@dataclass
class TokenDataset(FlatSamples):
    """A whole dataset in memory: concatenated tensors and sample boundaries."""

    manifest: dict

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def tokenizer_fingerprint(self) -> str | None:
        return self.manifest.get("tokenizer_fingerprint")

    @property
    def chat_template_fingerprint(self) -> str | None:
        return self.manifest.get("chat_template_fingerprint")

    @property
    def thinking(self) -> bool | None:
        """Thinking mode the chat template was rendered in; None in manifests that predate the field."""
        return self.manifest.get("thinking")


def read_at_most(store, key: str, limit: int, error: type[Exception], what: str) -> bytes:
    """The bytes of one object, read no further than ``limit``: ``error`` naming it and the limit when it is larger."""
    with store.open_read(key) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise error(f"{store.url(key)}: larger than {limit:,} bytes, the most {what} may take; refused")
    return data


def _read_manifest(store) -> dict:
    """The dataset's manifest, bounded and checked field by field (it comes from the user's storage)."""
    from dfp_shared.storage.store import NotFound

    where = store.url(MANIFEST)
    try:
        manifest = json.loads(read_at_most(store, MANIFEST, MAX_MANIFEST_BYTES, DatasetError, "a dataset manifest"))
    except NotFound:
        raise DatasetError(f"{where}: no dataset manifest (has the tokenize job finished?)") from None
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, DatasetError):
            raise
        raise DatasetError(f"{where}: not a JSON manifest ({type(exc).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DatasetError(f"{where}: format {found!r}, expected {FORMAT!r}")
    entries = manifest.get("shards", [])
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("key"), str) and isinstance(e.get("sha256"), str) for e in entries):
        raise DatasetError(f"{where}: 'shards' must be a list of entries, each with a string 'key' and 'sha256'")
    return manifest


def load_dataset(uri: str, endpoint_url: str | None = None, verify: bool = True, max_workers: int = 16) -> TokenDataset:
    """Read the manifest under ``uri`` and every shard it lists (in parallel), checksums verified."""
    from dfp_shared.storage.store import open_store

    store = open_store(uri, endpoint_url=endpoint_url)
    manifest = _read_manifest(store)
    entries = manifest.get("shards", [])
    shards = []
    for entry, (key, data) in zip(entries, store.get_many([e["key"] for e in entries], max_workers=max_workers)):
        if verify and hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise DatasetError(f"{store.url(key)}: checksum mismatch with the manifest")
        shards.append(decode_shard(data, store.url(key)))
    if not shards:
        return TokenDataset(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.uint8),
                            torch.zeros(1, dtype=torch.int64), [], manifest)
    input_ids = torch.cat([s.input_ids for s in shards])
    loss_mask = torch.cat([s.loss_mask for s in shards])
    bases = np.cumsum([0] + [s.input_ids.numel() for s in shards[:-1]])
    offsets = torch.cat([shards[0].offsets[:1]] + [s.offsets[1:] + int(b) for s, b in zip(shards, bases)])
    sample_ids = [sid for s in shards for sid in s.sample_ids]
    return TokenDataset(input_ids, loss_mask, offsets, sample_ids, manifest)
