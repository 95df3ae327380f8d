"""Fixtures of the generation tests: a loopback OpenAI-compatible server and prompt sets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .openai_server import LoopbackOpenAI


@pytest.fixture
def openai_server():
    server = LoopbackOpenAI().start()
    yield server
    server.stop()


def write_jsonl(path: Path, rows: list) -> Path:
    """Write rows (dicts, or raw strings written as they are) one per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
