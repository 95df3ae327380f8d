"""A chat corpus built from the running interpreter's standard library.

Every function or method with a docstring becomes one conversation: the user asks for the
function by name, module and the docstring's first line; the assistant answers with the
function's source. The order is deterministic (sorted module paths, then source order), and a
hash of the module name splits the functions into a "train" and a "held-out" prompt set.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sysconfig
import textwrap
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

SKIP_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__",
                       "turtledemo", "__phello__", "ensurepip"})
HELD_OUT_PERCENT = 10  # share of modules (by hash of the module name) whose functions form the held-out set
MAX_LINES = 40
MAX_CHARS = 1600


@dataclass(frozen=True)
class FunctionRecord:
    """One documented function of the standard library."""

    module: str
    qualname: str
    summary: str
    source: str

    @property
    def id(self) -> str:
        return f"{self.module}:{self.qualname}"

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]

    @property
    def split(self) -> str:
        return module_split(self.module)

    def request(self) -> str:
        """The user's request; ``def name`` is tokenized as in the answer's first line, so it can be copied."""
        if "." in self.qualname:
            owner = self.qualname.rsplit(".", 1)[0]
            return (f"Write the Python method `def {self.name}` of class `{owner}` in module `{self.module}`: "
                    f"{self.summary}")
        return f"Write the Python function `def {self.name}` of module `{self.module}`: {self.summary}"

    def prompt_messages(self) -> list[dict]:
        return [{"role": "user", "content": self.request()}]

    def messages(self) -> list[dict]:
        return [*self.prompt_messages(), {"role": "assistant", "content": self.source}]

    def to_json(self) -> dict:
        return {"module": self.module, "qualname": self.qualname, "summary": self.summary, "source": self.source}


def module_split(module: str) -> str:
    """"held-out" for about HELD_OUT_PERCENT of the modules (by a hash of the name), else "train"."""
    bucket = int.from_bytes(hashlib.sha256(module.encode()).digest()[:4], "big") % 100
    return "held-out" if bucket < HELD_OUT_PERCENT else "train"


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_modules(root: str | os.PathLike | None = None) -> list[tuple[str, Path]]:
    """(dotted module name, path) of the standard library's ``*.py`` files, sorted by path."""
    base = Path(root or stdlib_dir())
    found = []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if any(part in SKIP_DIRS or part.startswith(("config-", "plat-")) for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata"):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts:
            found.append((".".join(parts), path))
    return found


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Module-level functions and class methods (nested classes too), with their qualified names."""
    stack: list[tuple[str, ast.AST]] = [("", tree)]
    while stack:
        prefix, node = stack.pop(0)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
            elif isinstance(child, ast.ClassDef):
                stack.append((f"{prefix}{child.name}.", child))


def module_functions(source: str, module: str, *, max_lines: int = MAX_LINES,
                     max_chars: int = MAX_CHARS) -> list[FunctionRecord]:
    """The documented functions of one module's source, in source order; [] if it does not parse."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    records = []
    for qualname, node in _functions(tree):
        doc = ast.get_docstring(node)
        summary = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
        if not summary:
            continue
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        body = lines[start:node.end_lineno]
        if len(body) > max_lines:
            continue
        text = textwrap.dedent("\n".join(body)).strip("\n")
        if len(text) > max_chars or "\t" in text:
            continue
        records.append((start, qualname, FunctionRecord(module, qualname, summary, text)))
    return [record for _, _, record in sorted(records, key=lambda item: item[:2])]


def stdlib_functions(*, limit: int | None = None, root: str | os.PathLike | None = None,
                     max_lines: int = MAX_LINES, max_chars: int = MAX_CHARS) -> list[FunctionRecord]:
    """The documented functions of the standard library, in a deterministic order (the first ``limit``)."""
    out: list[FunctionRecord] = []
    seen: set[str] = set()
    for module, path in stdlib_modules(root):
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for record in module_functions(source, module, max_lines=max_lines, max_chars=max_chars):
            if record.id in seen:  # a redefinition (e.g. per-platform variants): keep the first
                continue
            seen.add(record.id)
            out.append(record)
            if limit is not None and len(out) >= limit:
                return out
    return out


def prompt_records(records: Iterable[FunctionRecord], split: str | None = None) -> list[dict]:
    """Prompt-set records ``{"id", "messages"}`` (the user turn only) of one split (None: all)."""
    return [{"id": r.id, "messages": r.prompt_messages()} for r in records if split is None or r.split == split]


def train_prompts(records: Iterable[FunctionRecord]) -> list[dict]:
    return prompt_records(records, "train")


def held_out_prompts(records: Iterable[FunctionRecord]) -> list[dict]:
    return prompt_records(records, "held-out")


def sample_prompts(records: Iterable[FunctionRecord], n: int, split: str = "train", seed: int = 0) -> list[dict]:
    """``n`` prompts of a split, picked deterministically (by a seeded hash of the id) across the library."""
    pool = prompt_records(records, split)
    pool.sort(key=lambda p: hashlib.sha256(f"{seed}:{p['id']}".encode()).hexdigest())
    return sorted(pool[:n], key=lambda p: p["id"])


def write_prompt_set(path: str | os.PathLike, prompts: Iterable[dict]) -> Path:
    """Write prompt records as JSONL (one object a line)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts), encoding="utf-8")
    return out
