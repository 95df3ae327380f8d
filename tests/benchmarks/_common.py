"""Shared bits of the benchmarks: import path, timing, the one-line JSON result."""

from __future__ import annotations

import json
import os
import subprocess
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


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), or None where unavailable."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(cmd: list[str], env: dict, port: int) -> subprocess.Popen:
    """``cmd`` started with ``env``, once it listens on ``port`` (60 s at most; its stderr's tail in the error)."""
    from tests.support.servers import wait_for_port

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_port(port, timeout=60)
    except Exception:
        proc.kill()
        raise RuntimeError(f"server did not start: {proc.stderr.read().decode()[-2000:]}") from None
    return proc
