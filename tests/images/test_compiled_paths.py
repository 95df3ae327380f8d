"""What a GPU node runs first, run from the CUDA image on the CPU as the chart runs it.

The trainer's container of the rendered chart (its user 10001, read-only root filesystem, capabilities
dropped, the chart's environment, its /tmp and /cache volumes) runs, with only its command replaced:

* the drafter's flex attention compiled by ``torch.compile`` (Inductor's C++ backend on the CPU: the
  image's g++, OpenMP and torch's headers) against the same attention run eagerly and against SDPA,
  the compiled code landing on the cache volume (``TORCHINDUCTOR_CACHE_DIR``);
* Triton's own stub build (``triton.runtime.build``: the function its CUDA driver and kernel launchers
  go through at first use) on a small C module including ``Python.h`` and ``cuda.h``, which loads and
  answers, cached on the cache volume (``TRITON_CACHE_DIR``); and Triton's real CUDA driver stub
  compiled by the same ``_build`` (linking libcuda needs a GPU node's driver, so it is compiled only);
* the GPU check's CPU rehearsal (``tests/benchmarks/gpu_check.py``, mounted read-only as the README's
  ``podman run`` and ``kubectl run`` lines mount it) with every stage passing.

``make images-check-cuda`` runs it; the CPU image (no compiler, no compiled paths) skips it, as does a
machine without podman or ``DFLASH_TEST_IMAGE``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_chart_cluster import chart_values
from tests.support.chart import REPO_ROOT, render_objects
from tests.support.cli import cli_env
from tests.support.local_cluster import Containers, LocalCluster

PODMAN = shutil.which("podman")
IMAGE = os.environ.get("DFLASH_TEST_IMAGE", "")
pytestmark = [
    pytest.mark.skipif(PODMAN is None, reason="podman is not installed (make images-check needs podman, runc and mmdebstrap)"),
    pytest.mark.skipif(not IMAGE, reason="DFLASH_TEST_IMAGE is not set: `make images-check-cuda` builds the image and sets it"),
]

WORKLOAD = "dflash-trainer"
BENCHMARKS = REPO_ROOT / "tests" / "benchmarks"
CHECKS_AT = "/checks/benchmarks"  # where the README's podman and kubectl lines mount tests/benchmarks


@pytest.fixture(scope="module")
def cuda_image():
    found = subprocess.run([PODMAN, "image", "inspect", IMAGE], capture_output=True, text=True)
    assert found.returncode == 0, f"image {IMAGE} is not built (make images-cuda)"
    labels = json.loads(found.stdout)[0].get("Labels") or {}
    if labels.get("org.opencontainers.image.title") != "dflash-pipeline-cuda":
        pytest.skip("the compiled paths are the CUDA image's (this is the CPU image)")
    return IMAGE


@pytest.fixture
def cluster(tmp_path, cuda_image):
    objects = render_objects(chart_values("http://127.0.0.1:9"))
    refs = {c["image"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")
            for c in o["spec"]["template"]["spec"]["containers"] if c.get("command", [None])[0] == "dflash-pipeline"}
    creds = {"AWS_ACCESS_KEY_ID": "images", "AWS_SECRET_ACCESS_KEY": "images-secret"}
    local = LocalCluster(objects, tmp_path / "cluster", base_env=cli_env(), secrets={"s3-creds": creds},
                         containers=Containers(dict.fromkeys(refs, cuda_image)))
    yield local
    local.stop()


def run_python(cluster: LocalCluster, code: str, timeout: float = 900) -> dict:
    """Run Python in the trainer's container as the chart runs it; the JSON its last line prints."""
    run = cluster.run_once(WORKLOAD, command=["python", "-c", code], timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def files_under(folder: Path, suffix: str) -> list[Path]:
    return [p for p in folder.rglob(f"*{suffix}") if p.is_file()]


COMPILED_FLEX = """
import json, os, torch
from dfp_trainer.drafter.attention import attend, flex_attend, training_masks

torch.manual_seed(0)
types = ["full_attention", "sliding_attention"]
anchors = torch.tensor([[1, 6, 11], [0, 4, 13]])
block, context = 4, 18
flex = training_masks(anchors, block, context, types, sliding_window=5, backend="flex")
sdpa = training_masks(anchors, block, context, types, sliding_window=5, backend="sdpa")
q = torch.randn(2, 4, anchors.shape[1] * block, 16)
k, v = (torch.randn(2, 2, context + anchors.shape[1] * block, 16) for _ in range(2))
out = {"uid": os.getuid(), "compiler": __import__("torch._inductor.cpp_builder", fromlist=["x"]).get_cpp_compiler()}
for kind in types:
    compiled = flex_attend(q, k, v, flex.for_layer(kind), compiled=True)
    eager = flex_attend(q, k, v, flex.for_layer(kind), compiled=False)
    reference = attend(q, k, v, sdpa, kind)
    out[kind] = {"compiled_vs_eager": (compiled - eager).abs().max().item(),
                 "eager_vs_sdpa": (eager - reference).abs().max().item(), "finite": bool(compiled.isfinite().all())}
print(json.dumps(out))
"""


def test_compiled_flex_attention_equals_eager_in_the_image(cluster):
    seen = run_python(cluster, COMPILED_FLEX)
    assert seen["uid"] == 10001 and seen["compiler"].endswith("g++"), seen
    for kind in ("full_attention", "sliding_attention"):
        row = seen[kind]
        assert row["finite"] and row["compiled_vs_eager"] < 1e-5 and row["eager_vs_sdpa"] < 1e-5, (kind, row)
    cache = cluster.once_volume(WORKLOAD, "cache")
    # Inductor's generated C++ and the shared objects g++ built from it, on the chart's cache volume
    assert files_under(cache / "torchinductor", ".so") and files_under(cache / "torchinductor", ".cpp"), \
        sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))[:40]


TRITON_STUB = r'''
import json, os, tempfile, triton
from triton.runtime.build import _build, compile_module_from_src
from triton.backends.nvidia import driver

source = """
#include <cuda.h>
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject *cuda_api(PyObject *self, PyObject *args) { return PyLong_FromLong(CUDA_VERSION); }
static PyMethodDef methods[] = {{"cuda_api", cuda_api, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "stub_check", NULL, -1, methods};
PyMODINIT_FUNC PyInit_stub_check(void) { return PyModule_Create(&module); }
"""
stub = compile_module_from_src(source, "stub_check", include_dirs=driver.include_dirs)
with tempfile.TemporaryDirectory() as tmp:  # the CUDA driver's real stub, compiled (libcuda is the node's)
    real = _build("cuda_utils", os.path.join(os.path.dirname(driver.__file__), "driver.c"), tmp, [],
                  driver.include_dirs, [], [])
    real_bytes = os.path.getsize(real)
print(json.dumps({"uid": os.getuid(), "triton": triton.__version__, "cuda_api": stub.cuda_api(),
                  "stub": stub.__file__, "driver_stub_bytes": real_bytes}))
'''


def test_triton_builds_its_stub_in_the_image(cluster):
    seen = run_python(cluster, TRITON_STUB, timeout=300)
    assert seen["uid"] == 10001 and seen["cuda_api"] >= 12000, seen  # CUDA_VERSION from Triton's cuda.h
    assert seen["stub"].startswith("/cache/triton/") and seen["driver_stub_bytes"] > 0, seen
    built = files_under(cluster.once_volume(WORKLOAD, "cache") / "triton", ".so")
    assert [p.name for p in built if p.name.startswith("stub_check")], built


def test_gpu_check_rehearsal_runs_in_the_image(cluster):
    out = "/tmp/gpu-check.json"
    run = cluster.run_once(WORKLOAD, command=["python", f"{CHECKS_AT}/gpu_check.py", "--device", "cpu", "--out", out],
                           host_folders={CHECKS_AT: BENCHMARKS}, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads((cluster.once_volume(WORKLOAD, "tmp") / "gpu-check.json").read_text())
    assert report["errors"] == {}, report["errors"]
    assert report["rehearsal"] is True and "8-GPU node split" in run.stdout
    device = report["device"]
    assert device["type"] == "cpu" and device["torch"].startswith("2.13.0") and device["cuda"], device
    for stage in ("target_forward", "drafter_step", "draft_vocab", "pipeline_inprocess", "transfer", "generation",
                  "pipeline_colocated", "node_split", "hidden_cache"):
        assert stage in report and stage in report["stage_seconds"], stage
    assert report["pipeline_inprocess"]["tokens_per_s"] > 0 and report["pipeline_colocated"]["shm_bytes"] > 0
