"""How ``make test`` spreads the suite over its processes (pytest-xdist's ``--dist loadgroup``, its groups handed
out in collection order: ``--no-loadscope-reorder``).

Every test belongs to a group that one process runs whole: its file by default (a module's fixtures are made
once), or a group of its own named in ``OWN_GROUPS``: the slow tests of a file that share nothing costly, so two
processes can take them at once and no single file sets the wall time. The groups known to take minutes are handed
out first, longest first (``LONGEST_FIRST``); xdist's own order (most tests first) started them last, so the run
ended waiting on one process. A test renamed out of these tables only falls back to its file's group."""

from __future__ import annotations

import pytest

# node id prefix -> the group it runs in instead of its file's
OWN_GROUPS = {
    # one vLLM engine each (an engine serves the one drafter it started with); the first two share theirs
    "tests/e2e/test_vllm_serve.py::test_served_drafter_outputs_equal_greedy": "vllm-served",
    "tests/e2e/test_vllm_serve.py::test_generate_job_with_the_openai_engine": "vllm-served",
    "tests/e2e/test_vllm_serve.py::test_a_pruned_vocabulary_drafter": "vllm-pruned",
    "tests/e2e/test_vllm_serve.py::test_a_drafter_of_a_llama_target": "vllm-llama",
    "tests/e2e/test_vllm_serve.py::test_a_sliding_window_drafter": "vllm-sliding",
    "tests/e2e/test_vllm_serve.py::test_a_drafter_started_from_the_targets_layers": "vllm-target-layers",
    # a whole demo in a subprocess each
    "tests/e2e/test_hybrid_pipeline.py::test_demo_pipeline_on_a_hybrid_target": "demo-hybrid",
    "tests/e2e/test_hybrid_pipeline.py::test_demo_pipeline_on_a_llama_target": "demo-llama",
    # a one-rank run and a two-rank torchrun each
    "tests/trainer/loop/test_ddp.py::test_two_ranks_match_one_rank_with_the_same_global_batch[dflash]": "ddp-dflash",
    "tests/trainer/loop/test_ddp.py::test_two_ranks_match_one_rank_with_the_same_global_batch[dspark]": "ddp-dspark",
    # a trainer group of two pods each
    "tests/trainer/test_group.py::test_a_cancel_or_sigterm_stops_every_rank_with_one_checkpoint[cancel]":
        "trainer-group-cancel",
    "tests/trainer/test_group.py::test_a_cancel_or_sigterm_stops_every_rank_with_one_checkpoint[sigterm]":
        "trainer-group-sigterm",
}

# the groups that take minutes, longest first (a fresh 2-core machine); vLLM's groups alternate with others, so
# while the first installs vLLM's environment (cold: minutes) the other process is not left waiting for it
LONGEST_FIRST = [
    "vllm-served",
    "e2e/test_chart_cluster",
    "vllm-pruned",
    "trainer/test_group",
    "demo-hybrid",
    "demo-llama",
    "vllm-llama",
    "e2e/test_vllm_dspark",
    "vllm-sliding",
    "trainer-group-cancel",
    "vllm-target-layers",
    "trainer-group-sigterm",
    "e2e/test_vllm_dflash2",
    "ddp-dflash",
    "ddp-dspark",
]


def file_group(nodeid: str) -> str:
    """A test's default group: its file under ``tests/``, without ``.py``."""
    path = nodeid.split("::", 1)[0]
    return path.removeprefix("tests/").removesuffix(".py")


def group_of(nodeid: str) -> str:
    return next((group for prefix, group in OWN_GROUPS.items() if nodeid.startswith(prefix)), file_group(nodeid))


def arrange(items: list[pytest.Item]) -> None:
    """Give every test without an ``xdist_group`` mark its group, and put the longest groups first (a stable sort:
    every other test keeps its place)."""
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    groups = {}
    for item in items:
        marks = [m.args[0] if m.args else m.kwargs.get("name", "default") for m in item.iter_markers("xdist_group")]
        if not marks:
            marks = [group_of(item.nodeid)]
            item.add_marker(pytest.mark.xdist_group(marks[0]))
        groups[item.nodeid] = min(rank.get(str(m), len(rank)) for m in marks)
    items.sort(key=lambda item: groups[item.nodeid])
