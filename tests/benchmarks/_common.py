"""Shared bits of the benchmarks: import path, timing, the one-line JSON result."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for p in (str(ROOT / "services"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def best_of(fn, repeats: int = 3) -> float:
    """Shortest wall time of ``repeats`` runs of ``fn()`` (seconds)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def report(name: str, unit: str, project: float, baseline: float | None = None, limit: float | None = None,
           **extra) -> dict:
    """Print the human summary and, as the last line, the JSON figures (higher is better)."""
    doc = {"benchmark": name, "unit": unit, "project": round(project, 3)}
    if baseline:
        doc["baseline"] = round(baseline, 3)
        doc["vs_baseline"] = round(project / baseline, 3)
    if limit:
        doc["limit"] = round(limit, 3)
        doc["vs_limit"] = round(project / limit, 3)
    doc.update(extra)
    print(f"{name}: project {project:,.1f} {unit}"
          + (f" | baseline {baseline:,.1f} ({project / baseline:.2f}x)" if baseline else "")
          + (f" | limit {limit:,.1f} ({project / limit:.2f} of it)" if limit else ""))
    print(json.dumps(doc))
    return doc
