# Two commands on a fresh machine with Python 3.10+:
#   make demo   - the whole pipeline end to end on the CPU with a small model
#   make test   - lint and the full test suite (starts the servers it needs; the install from nothing: make test-fresh-install)
# Both create .venv and install the project into it first (no root needed).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo docs test test-fresh-install lint install protos bench gpu-check gpu-check-image serve-check images images-cuda images-check images-check-cuda clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dflash-pipeline demo $(DEMO_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check services tests

# one test process per core, at most four; each starts its own servers; a test file stays on one process unless
# tests/support/schedule.py splits its slow tests into groups, and the groups known to be slow are handed out first
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

test: lint
	$(BIN)/python -m pytest -q --durations=15 -n $(TEST_JOBS) --dist loadgroup --no-loadscope-reorder -m "not fresh_install" tests

# the tests that install the project from nothing (`make demo` in a new virtual environment, about 12 minutes);
# CI runs them after `make test`
test-fresh-install: $(STAMP)
	$(BIN)/python -m pytest -q --durations=5 -p no:xdist -m fresh_install tests

# the docs site (mkdocs-material) into site/; strict: a broken link, page or anchor fails it
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

protos: $(STAMP)
	$(BIN)/python -m dfp_dev.protogen

bench: $(STAMP)
	@for b in tests/benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

# the CUDA paths measured on this machine's GPU in under eight minutes (a CPU rehearsal without one)
gpu-check: $(STAMP)
	$(BIN)/python tests/benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# the exported drafter served by a real vLLM on the CPU (its own cached environment, installed on first
# use), outputs checked against greedy and acceptance against the project's; by default the drafter of
# `make demo` on its learnable target, on that target's held-out prompts (vLLM's CPU attention serves no head
# size under 32: a random target needs `DEMO_ARGS="--target tiny --head-dim 32"`)
SERVE_TARGET  ?= $(firstword $(wildcard demo-output/store/models/learnable-qwen3-*) demo-output/store/models/learnable-qwen3)
SERVE_DRAFTER ?= demo-output/store/train/drafter

serve-check: $(STAMP)
	$(BIN)/dflash-pipeline serve-check --target $(SERVE_TARGET) --drafter $(SERVE_DRAFTER) $(SERVE_CHECK_ARGS)

# the images built with podman (and runc) from a Debian base made here by mmdebstrap, tagged as the chart
# pulls them; only package registries (PyPI, Debian) need be reachable (docker/podman-build.sh)
IMAGE_REPO ?= ghcr.io/dflash-pipeline
IMAGE_TAG  ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
export IMAGE_REPO IMAGE_TAG

images:
	docker/podman-build.sh cpu

images-cuda:
	docker/podman-build.sh cuda

# every service run from the image as the chart runs it (tests/images); the CUDA image's check runs its CPU paths
images-check: images $(STAMP)
	DFLASH_TEST_IMAGE=$(IMAGE_REPO)/dflash-pipeline-cpu:$(IMAGE_TAG) $(BIN)/python -m pytest -q -p no:xdist tests/images

images-check-cuda: images-cuda $(STAMP)
	DFLASH_TEST_IMAGE=$(IMAGE_REPO)/dflash-pipeline-cuda:$(IMAGE_TAG) $(BIN)/python -m pytest -q -p no:xdist tests/images

# the GPU check run from the CUDA image as the chart runs it (user 10001, read-only root, /tmp and /cache
# writable), the repository's tests/benchmarks mounted read-only, the figures written to gpu-check-out/;
# without a GPU: make gpu-check-image GPU_CHECK_DEVICES= GPU_CHECK_ARGS="--device cpu" (the CPU rehearsal)
GPU_CHECK_IMAGE   ?= $(IMAGE_REPO)/dflash-pipeline-cuda:$(IMAGE_TAG)
GPU_CHECK_DEVICES ?= --device nvidia.com/gpu=all

gpu-check-image:
	mkdir -p gpu-check-out
	podman --runtime runc run --rm --pull never $(GPU_CHECK_DEVICES) --user 10001:10001 --read-only \
	  --tmpfs /tmp:rw,exec,mode=1777 --tmpfs /cache:rw,exec,U --shm-size 16g \
	  --ulimit nofile=20000 --ulimit nproc=32768 --cap-drop all --security-opt no-new-privileges \
	  --volume $(CURDIR)/tests/benchmarks:/checks/benchmarks:ro --volume $(CURDIR)/gpu-check-out:/out:U \
	  --entrypoint python $(GPU_CHECK_IMAGE) /checks/benchmarks/gpu_check.py --out /out/gpu-check.json $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache dflash-data demo-output gpu-check-out
