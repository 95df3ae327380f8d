"""Importing a GGUF checkpoint as an ordinary Hugging Face directory: safetensors weights, config, tokenizer
and chat template.

Users often hold a target as one GGUF file (llama.cpp's format, usually quantised). transformers reads it
(``gguf_file=``, de-quantising to float32), but a model loaded that way refuses ``save_pretrained``; the
import builds the plain architecture from the file's config, loads the de-quantised state dict into it and
saves that, so every service then loads the target through :func:`dfp_shared.models.loading.load_causal_lm` like
any other checkpoint.

The file is data, never code: its size is bounded before it is read (an object in S3 by its length, before
it is downloaded, and copied no further than that); it is parsed and converted in a child process with a
memory ceiling and a wall-time budget (:func:`convert_confined`: ``DFLASH_GGUF_MEMORY_MB``,
``DFLASH_GGUF_TIMEOUT_S``), which a cancel ends at once; there its header is checked (magic, version, counts,
then every length, count and offset against the file's bytes: :mod:`.gguf_header`) before transformers parses
it, its architecture must be one transformers maps to a built-in model class, and the
result holds no code and no ``auto_map``. The destination lies inside the storage roots and is claimed for its
principal like every job output: by :func:`import_gguf` (the ``models import-gguf`` command), or by the worker's
admission of an ``import_gguf`` job, which then runs :func:`import_claimed`, the import both share.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from dfp_shared.config import CommonSettings
from dfp_shared.models import gguf_header
from dfp_shared.models.confined import ConfinedError, LimitExceeded, Limits, run_confined
from dfp_shared.printable import printable
from dfp_shared.storage.ownership import OutputClaims
from dfp_shared.storage.roots import StorageRoots
from dfp_shared.storage.store import RANGE_READ_SIZE, NotFound, ObjectStore, open_store, split_uri

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
DEFAULT_MAX_BYTES = 64 << 30
MAX_TENSORS = 100_000
MAX_METADATA = 100_000
MIN_BITS_PER_WEIGHT = 1.5  # the densest GGUF quantisations (IQ1_S) store about 1.56 bits per weight
DEFAULT_LIMITS = Limits(memory_bytes=32 << 30, seconds=3600.0)


class GGUFError(ValueError):
    """A GGUF file that cannot be imported; the message names the file and the reason (without control
    characters: it quotes the file's own names)."""

    def __init__(self, message: str):
        super().__init__(printable(message))


class GGUFImportSettings(CommonSettings):
    """Settings of whatever imports GGUF files (the ``models import-gguf`` command, the trainer workers)."""

    gguf_max_bytes: int = Field(DEFAULT_MAX_BYTES, ge=1, le=1 << 42,
                                description="Largest GGUF file an import reads, in bytes (checked before reading).")
    gguf_memory_mb: int = Field(DEFAULT_LIMITS.memory_bytes >> 20, ge=64, le=1 << 22,
                                description="Memory (MiB) the process that parses and converts a GGUF file may use "
                                            "beyond its imported libraries; over it the import fails.")
    gguf_timeout_s: float = Field(DEFAULT_LIMITS.seconds, gt=0, le=86400,
                                  description="Wall time (seconds) a GGUF file's parse and conversion may take.")

    def gguf_limits(self) -> Limits:
        return Limits(memory_bytes=self.gguf_memory_mb << 20, seconds=self.gguf_timeout_s)


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    size: int
    version: int
    architecture: str
    tensors: int


def check_gguf(path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES, name: str | None = None,
               check: Callable[[], None] | None = None) -> GGUFInfo:
    """Check a GGUF file before anything parses it: size, magic, version, counts, every claim of its header
    against its bytes (``check`` called as the scan goes), then its architecture.

    Raises GGUFError naming the file (as ``name``, e.g. its storage URI, when given) and what is wrong.
    """
    path = Path(path)
    where = name or str(path)
    if not path.is_file():
        raise GGUFError(f"{where}: not a file")
    size = path.stat().st_size
    if size > max_bytes:
        raise GGUFError(f"{where}: {size:,} bytes is over the import limit of {max_bytes:,} bytes")
    with path.open("rb") as fh:
        head = fh.read(24)
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        raise GGUFError(f"{where}: not a GGUF file (it does not start with the bytes 'GGUF')")
    version, tensors, metadata = struct.unpack("<IQQ", head[4:24])
    if version not in GGUF_VERSIONS:
        raise GGUFError(f"{where}: GGUF version {version} is not supported (expected one of {GGUF_VERSIONS})")
    if tensors > MAX_TENSORS or metadata > MAX_METADATA:
        raise GGUFError(f"{where}: header claims {tensors:,} tensors and {metadata:,} metadata entries "
                        f"(at most {MAX_TENSORS:,} and {MAX_METADATA:,})")
    try:  # every length, count and offset bounded by the file's bytes before any parser believes one
        header = gguf_header.scan(path, MAX_TENSORS, MAX_METADATA, check)
    except gguf_header.HeaderError as exc:
        raise GGUFError(f"{where}: malformed GGUF ({exc})") from None
    architecture = _architecture(header, where)
    return GGUFInfo(path=path, size=size, version=version, architecture=architecture, tensors=tensors)


def _architecture(header: gguf_header.Header, where: str) -> str:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    architecture = header.metadata.get("general.architecture")
    if not isinstance(architecture, str) or not architecture:
        raise GGUFError(f"{where}: no general.architecture in its metadata")
    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{where}: architecture {architecture!r} has no built-in transformers model "
                        f"(supported: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})")
    return architecture


def convert_gguf(path: str | Path, out_dir: str | Path, max_bytes: int = DEFAULT_MAX_BYTES,
                 name: str | None = None) -> Path:
    """Write ``path`` (a GGUF file) as a safetensors Hugging Face directory ``out_dir`` (float32 weights);
    errors name the file as ``name`` when given."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    info = check_gguf(path, max_bytes, name)
    where = name or str(info.path)
    # transformers also reads tokenizer and template files beside the GGUF (following links): the file must be
    # alone in its folder, as :func:`import_claimed` puts it; a folder with anything else is refused
    folder, name = info.path.parent, info.path.name
    others = sorted(p.name for p in folder.iterdir() if p.name != name)
    if others:
        raise GGUFError(f"{where}: the GGUF file must be alone in its folder to be imported (beside it: {others[:5]})")
    out = Path(out_dir)
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
        with torch.device("meta"):  # the size its metadata describes, before any memory is spent on it
            params = sum(t.numel() for t in AutoModelForCausalLM.from_config(config).parameters())
        if params > info.size * 8 / MIN_BITS_PER_WEIGHT:
            raise GGUFError(f"{where}: its metadata describes {params:,} parameters, more than {info.size:,} bytes "
                            f"hold at {MIN_BITS_PER_WEIGHT} bits per weight")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                      trust_remote_code=False)
    except GGUFError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a malformed file provokes in transformers: no retry helps
        raise GGUFError(f"{where}: transformers cannot read it ({type(exc).__name__}: {exc})") from None
    out.mkdir(parents=True, exist_ok=True)
    config.architectures = [type(loaded).__name__]
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise GGUFError(f"{where}: its tensors do not fit {type(plain).__name__} "
                        f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if not tokenizer.chat_template:
        log.warning("the GGUF file carries no chat template", extra={"file": where})
    _check_no_code(out)
    (out / "import.json").write_text(json.dumps({"source": info.path.name, "gguf_version": info.version,
                                                  "architecture": info.architecture, "bytes": info.size}, indent=1))
    return out


def convert_confined(path: Path, out_dir: Path, max_bytes: int, name: str, limits: Limits = DEFAULT_LIMITS,
                     check: Callable[[], None] | None = None) -> Path:
    """:func:`convert_gguf` (header scan included) in a child process under ``limits``
    (:mod:`dfp_shared.models.confined`); ``check`` is called every fraction of a second (what it raises ends the
    child and propagates). A limit exceeded is a :class:`GGUFError` naming the file and the limit."""
    kwargs = {"path": str(path), "out_dir": str(out_dir), "max_bytes": max_bytes, "name": name}
    try:
        outcome = run_confined(f"{__name__}:_convert_in_child", kwargs, limits, check=check,
                               preload=("torch", "transformers", "gguf"))
    except LimitExceeded as exc:
        raise GGUFError(f"{name}: the import was stopped: {exc.message} (the memory limit is "
                        f"{limits.memory_bytes >> 20} MiB, DFLASH_GGUF_MEMORY_MB; the time limit "
                        f"{limits.seconds:g} s, DFLASH_GGUF_TIMEOUT_S)") from None
    except ConfinedError as exc:
        if exc.kind == "GGUFError":
            raise GGUFError(exc.message) from None
        raise RuntimeError(f"{name}: the import failed ({exc})") from None
    log.info("GGUF converted", extra={"file": name, "peak_rss_mb": outcome.peak_rss_bytes >> 20,
                                      "seconds": round(outcome.seconds, 1)})
    return Path(outcome.value)


def _convert_in_child(path: str, out_dir: str, max_bytes: int, name: str) -> str:
    return str(convert_gguf(path, out_dir, max_bytes, name))


def _check_no_code(directory: Path) -> None:
    """What an import writes holds tensors and JSON/text only: no code, no ``auto_map``."""
    for file in directory.rglob("*"):
        if file.suffix in (".py", ".pyc", ".bin", ".pt", ".pkl", ".pickle"):
            raise GGUFError(f"refusing to write {file.name}: an imported model holds no code or pickles")
    config = json.loads((directory / "config.json").read_text())
    if "auto_map" in config:
        raise GGUFError("refusing a config with auto_map: an imported model loads without remote code")


def _local_source(source: str, roots: StorageRoots, scratch: Path, endpoint_url: str | None, max_bytes: int) -> Path:
    """The GGUF file copied alone into ``scratch`` (no more than ``max_bytes``): a local file (inside the roots
    after resolving symlinks) or an object downloaded once its length is known to be within ``max_bytes``."""
    canonical = roots.check(source, "source")  # local paths: checked after resolving symlinks
    if canonical.startswith("file://"):
        local = Path(os.path.realpath(canonical[len("file://"):]))
        dest = scratch / local.name
        try:
            with local.open("rb") as src, dest.open("wb") as out:
                copied = _copy_at_most(src, out, max_bytes + 1)
        except FileNotFoundError:
            raise GGUFError(f"{source}: no such file") from None
        except IsADirectoryError:
            raise GGUFError(f"{source}: a directory, not a GGUF file") from None
        if copied > max_bytes:
            raise GGUFError(f"{source}: {local.stat().st_size:,} bytes is over the import limit of {max_bytes:,} bytes")
        return dest
    root, key = split_uri(canonical)
    try:
        stream = open_store(root, endpoint_url=endpoint_url).open_read(key)  # one HEAD: the length, no data
    except NotFound as exc:
        raise GGUFError(str(exc)) from None
    dest = scratch / Path(key).name
    with stream, dest.open("wb") as out:
        size = stream.seek(0, io.SEEK_END)
        if size > max_bytes:
            raise GGUFError(f"{source}: {size:,} bytes is over the import limit of {max_bytes:,} bytes")
        stream.seek(0)
        # ranged reads end at the length the HEAD gave: no more than ``size`` bytes reach the disk
        shutil.copyfileobj(stream, out, RANGE_READ_SIZE)
    return dest


def _copy_at_most(src, out, limit: int) -> int:
    """Copy ``src`` to ``out`` until its end or ``limit`` bytes; returns the bytes copied."""
    copied = 0
    while copied < limit:
        chunk = src.read(min(RANGE_READ_SIZE, limit - copied))
        if not chunk:
            break
        out.write(chunk)
        copied += len(chunk)
    return copied


def upload_dir(local: Path, store: ObjectStore) -> list[str]:
    """Every file of ``local`` into ``store`` under its relative path; returns the keys written."""
    keys = []
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        key = file.relative_to(local).as_posix()
        store.put_file(key, file)
        keys.append(key)
    return keys


PHASES = ("fetched", "converted", "written")
"""What :func:`import_claimed` reports as it goes, in order."""


def import_claimed(source: str, output: str, roots: StorageRoots, *, endpoint_url: str | None = None,
                   max_bytes: int = DEFAULT_MAX_BYTES, work_dir: str | None = None,
                   progress: Callable[..., None] | None = None, limits: Limits = DEFAULT_LIMITS,
                   check: Callable[[], None] | None = None) -> list[str]:
    """Import the GGUF file ``source`` into the model directory ``output``, which the caller has claimed for
    its principal; returns the keys written.

    Both URIs are checked against ``roots`` again before any I/O. Scratch files (the downloaded file, the
    converted model) live under ``work_dir`` (created if missing; default: the system temporary directory) and
    are removed after.
    ``progress(phase, **counts)`` is called after each of :data:`PHASES` (it may raise to stop the import
    there): ``fetched`` with ``source_bytes``, ``written`` with ``files`` and ``output_bytes``. The file is
    parsed and converted under ``limits`` in a child process, which ``check`` (a cancel) ends at once.
    """
    report = progress or (lambda phase, **counts: None)
    target = open_store(roots.check(output, "output"), endpoint_url=endpoint_url)
    if work_dir:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dfp-gguf-", dir=work_dir or None) as tmp:
        scratch = Path(tmp)
        (scratch / "source").mkdir()
        gguf_path = _local_source(source, roots, scratch / "source", endpoint_url, max_bytes)
        report("fetched", source_bytes=gguf_path.stat().st_size if gguf_path.is_file() else 0)
        check_gguf(gguf_path, max_bytes, source, check)  # a bad header is refused before a process starts
        converted = convert_confined(gguf_path, scratch / "model", max_bytes, source, limits, check)
        report("converted")
        keys = upload_dir(converted, target)
        written = sum(f.stat().st_size for f in converted.rglob("*") if f.is_file())
    report("written", files=len(keys), output_bytes=written)
    log.info("GGUF imported", extra={"source": source, "output": output, "files": len(keys), "bytes": written})
    return keys


def import_gguf(source: str, output: str, roots: StorageRoots, owner: str | None, *,
                endpoint_url: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                work_dir: str | None = None, limits: Limits = DEFAULT_LIMITS) -> list[str]:
    """Import the GGUF file ``source`` into the model directory ``output`` (``models import-gguf``); returns
    the keys written.

    Both URIs must lie inside ``roots``; ``output`` is claimed for ``owner`` like a job's output (a prefix
    another principal owns, or that holds data no job wrote, is refused), then :func:`import_claimed` runs.
    """
    roots.check_explicit_output(output, "output")
    OutputClaims(roots, endpoint_url).claim(output, owner, job_id="import-gguf", field="output")
    return import_claimed(source, output, roots, endpoint_url=endpoint_url, max_bytes=max_bytes, work_dir=work_dir,
                          limits=limits)
