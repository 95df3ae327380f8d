"""A drafter trained by the project, served by a real vLLM on the CPU (DFlash speculative decoding).

The target is a tiny Qwen3 with head_dim 32 (vLLM's CPU attention serves no smaller head); the drafter
trains for a few real steps on the target's own generations. vLLM runs from its own cached virtual
environment (``~/.cache/dflash-pipeline/vllm-<hash>``), installed by the first run (about two and a
half minutes with PyPI reachable). Without CI set, a machine that cannot install it skips these tests
saying why; with CI=true they run (and fail if vLLM cannot be had).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import httpx
import pytest
from dfp_dev.serving.check import ServeCheck, drafter_block_size, load_prompts, reference_decode, run_check
from dfp_dev.serving.vllm_server import VllmServer, live_group_members
from dfp_generation.settings import GenerationSettings
from dfp_generation.tasks import GenerationHandler, GenerationWorker
from dfp_shared.jobs.store import JobState, JobStore
from dfp_shared.jobs.submit import queue_job
from dfp_shared.specs.train import TrainSpec
from dfp_shared.storage.store import open_store

from tests.support.vllm_setup import self_generated_dataset
from tests.trainer.train_support import ROOT, subprocess_env, tiny_spec, torch_threads

# the first test to need vLLM installs its environment (minutes on a fresh machine) inside its own time
pytestmark = pytest.mark.timeout(1800)
MAX_NEW_TOKENS = 32


def _train_drafter(root, target, dataset: str | None = None, **spec_fields):
    """An exported drafter (block 4) trained for 30 real steps by the trainer on ``dataset`` (by default the target's
    own answers, generated here), with its report (thinking off)."""
    from dfp_trainer.run import run_local
    from dfp_trainer.settings import TrainerSettings

    dataset = dataset or self_generated_dataset(root, target)
    with torch_threads(1):
        spec = TrainSpec.model_validate(tiny_spec(dataset, target, f"file://{root}/run", steps=30, lr=1e-2,
                                                  enable_thinking=False, **spec_fields))
        result = run_local(spec, TrainerSettings(device="cpu", work_dir=str(root / "work")), resume=False)
    assert result.completed
    return root / "run" / "drafter"


@pytest.fixture(scope="module")
def trained_drafter(tmp_path_factory, servable_target, servable_dataset):
    return _train_drafter(tmp_path_factory.mktemp("served-drafter"), servable_target, servable_dataset)


@contextlib.contextmanager
def _running(server: VllmServer):
    """``server`` started, then stopped; no process outlives it."""
    server.start()
    try:
        yield server
    finally:
        leader = server.group.procs[server.name].pid
        server.stop()
    assert live_group_members(leader) == []  # the whole process group is gone: engine and workers too


def _serve(vllm_python, target, drafter, logs):
    """One vLLM server of the target with the drafter as DFlash speculator."""
    with _running(VllmServer(vllm_python, target, logs, drafter_dir=drafter,
                             num_speculative_tokens=drafter_block_size(drafter) - 1)) as server:
        yield server


@pytest.fixture(scope="module")
def served(vllm_python, servable_target, trained_drafter, tmp_path_factory):
    yield from _serve(vllm_python, servable_target, trained_drafter, tmp_path_factory.mktemp("vllm-logs"))


def test_served_drafter_outputs_equal_greedy_and_acceptance_equals_the_projects(served, servable_target,
                                                                               trained_drafter, tmp_path):
    messages, ids = load_prompts(None, limit=6)  # the demo's held-out prompts
    check = ServeCheck(servable_target, trained_drafter, messages, ids, MAX_NEW_TOKENS, False, tmp_path)
    result = run_check(check, served)
    print(json.dumps({k: result[k] for k in ("vllm", "project_whole_blocks", "project_tau")}))
    assert [r["id"] for r in result["prompts"]] == [f"demo-{i:03d}" for i in range(32, 38)]
    assert all(r["prompt_equal"] for r in result["prompts"])  # the same chat template, thinking off
    assert all(r["output_equal"] and r["speculative_equal"] for r in result["prompts"]), result["prompts"]
    assert result["outputs_equal"]
    vllm, project = result["vllm"], result["project_whole_blocks"]
    assert vllm["drafts"] == project["drafts"] > 0
    assert vllm["accepted"] == project["accepted"] > 0  # the trained drafter gets drafts accepted
    assert vllm["per_position"] == project["per_position"] and len(project["per_position"]) == 3
    assert vllm["acceptance_length"] == pytest.approx(project["acceptance_length"], abs=1e-12)
    assert result["acceptance_equal"]
    # the project's own tau cuts the last block at the budget: never above the whole-block count
    assert 1.0 <= result["project_tau"] <= project["acceptance_length"]


def _assert_served_as_the_project_drafts(result) -> None:
    assert all(r["prompt_equal"] for r in result["prompts"])  # the same chat template, thinking off
    assert all(r["output_equal"] and r["speculative_equal"] for r in result["prompts"]), result["prompts"]
    vllm, project = result["vllm"], result["project_whole_blocks"]
    assert vllm["drafts"] == project["drafts"] > 0
    assert vllm["accepted"] == project["accepted"] > 0
    assert vllm["per_position"] == project["per_position"]
    assert result["acceptance_equal"]


@pytest.fixture(scope="module")
def pruned_drafter(tmp_path_factory, servable_target, servable_dataset):
    """A drafter over a 512-token draft vocabulary chosen from its training data (its own head and d2t)."""
    return _train_drafter(tmp_path_factory.mktemp("served-pruned-drafter"), servable_target, servable_dataset,
                          draft_vocab_size=512)


def test_a_pruned_vocabulary_drafter_is_served_as_the_project_drafts(vllm_python, servable_target, pruned_drafter,
                                                                    tmp_path):
    """vLLM loads ``draft_vocab_size``, ``lm_head.weight`` and ``d2t`` from either export layout and scatters the
    draft logits to their target ids: outputs equal plain greedy, drafts and acceptance equal the project's."""
    speculators = pruned_drafter.parent / "drafter-speculators"
    for layout in (pruned_drafter, speculators):
        assert json.loads((layout / "config.json").read_text())["draft_vocab_size"] == 512
    messages, ids = load_prompts(None, limit=6)
    check = ServeCheck(servable_target, pruned_drafter, messages, ids, MAX_NEW_TOKENS, False, tmp_path)
    reference = reference_decode(check)
    servers = {"zlab": VllmServer(vllm_python, servable_target, tmp_path, drafter_dir=pruned_drafter,
                                  num_speculative_tokens=drafter_block_size(pruned_drafter) - 1, name="vllm-zlab"),
               # the speculators layout names its verifier (the target) and its draft length itself
               "speculators": VllmServer(vllm_python, speculators, tmp_path, name="vllm-speculators")}
    for layout, server in servers.items():
        with _running(server) as served:
            result = run_check(check, served, reference)
        print(layout, json.dumps({k: result[k] for k in ("vllm", "project_whole_blocks", "project_tau")}))
        assert result["outputs_equal"], layout
        _assert_served_as_the_project_drafts(result)


def test_generate_job_with_the_openai_engine_equals_the_transformers_engine(served, servable_target, tmp_path,
                                                                           redis_server, redis_client):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Tell me fact {i} about owls."}) + "\n"
                               for i in range(6)))
    model = httpx.get(f"{served.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    settings = GenerationSettings(redis_url=redis_server.url, openai_base_url=f"{served.base_url}/v1",
                                  lease_ms=60000, device="cpu")
    common = {"prompts": str(prompts), "temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "thinking": True,
              "shard_size": 6}
    outputs = {}
    for engine, extra in (("transformers", {"model": str(servable_target)}),
                          ("openai", {"openai_model": model, "concurrency": 2})):
        out = tmp_path / engine
        job, _ = queue_job(redis_client, "generate", {**common, **extra, "engine": engine, "output": str(out)})
        with torch_threads(1):
            GenerationWorker(GenerationHandler(redis_client, settings), block_ms=200).run(idle_exit_s=1.0)
        record = JobStore(redis_client).get(job.id)
        assert record.state == JobState.succeeded, record.error
        store = open_store(str(out))
        rows = [json.loads(line) for key in store.list("completions/") for line in store.get(key).decode().splitlines()]
        outputs[engine] = {r["id"]: r["messages"][-1] for r in rows}
    assert sorted(outputs["openai"]) == [f"p{i}" for i in range(6)]
    assert outputs["openai"] == outputs["transformers"]
    assert any(m["content"] for m in outputs["openai"].values())


def test_serve_check_refuses_what_vllms_cpu_runner_cannot_serve_before_starting_it(tiny_qwen3_dir, tmp_path):
    """The demo's default tiny target (head_dim 16) would kill vLLM's engine at the first request, and a
    drafter mixing sliding and full layers stops vLLM's start: both refused naming the file and field."""
    drafter, target = tmp_path / "drafter", tmp_path / "target"
    drafter.mkdir()
    target.mkdir()
    config = {"dflash_config": {"block_size": 4}, "head_dim": 32, "hidden_size": 64, "num_attention_heads": 2}
    (drafter / "config.json").write_text(json.dumps(config))
    (target / "config.json").write_text(json.dumps({"head_dim": 32}))

    def serve_check(target_dir, *extra):
        cmd = [sys.executable, "-m", "dfp_cli.main", "serve-check", "--target", str(target_dir), "--drafter",
               str(drafter), *extra]
        return subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), cwd=ROOT, timeout=120)

    proc = serve_check(tiny_qwen3_dir)
    assert proc.returncode == 2
    assert f"{tiny_qwen3_dir}/config.json: head_dim 16 of the target is not served by vLLM's CPU attention" in proc.stderr
    (drafter / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2, "sliding_window": 8,
                                                     "layer_types": ["sliding_attention", "full_attention"]}))
    proc = serve_check(target)
    assert proc.returncode == 2
    assert "drafter/config.json: layer_types mixes sliding_attention and full_attention" in proc.stderr
    assert "mixed sliding/full dflash drafts" in proc.stderr
    (drafter / "config.json").write_text('{"dflash_config": {"block_size": 1}}')
    proc = serve_check(target)
    assert proc.returncode == 2 and "dflash_config.block_size: expected an integer >= 2, got 1" in proc.stderr
    (drafter / "config.json").write_text(json.dumps(config))
    proc = serve_check(target, "--prompts", str(tmp_path / "none.jsonl"))
    assert proc.returncode == 2 and f"--prompts: prompt file {tmp_path}/none.jsonl does not exist" in proc.stderr
    (tmp_path / "bad.jsonl").write_text('{"prompt": "hi"}\n{"messages": 3}\n')
    proc = serve_check(target, "--prompts", str(tmp_path / "bad.jsonl"))
    assert proc.returncode == 2 and "bad.jsonl: line 2: messages: expected a list of messages" in proc.stderr

METRICS = """# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 31.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.796365519156943e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 93.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_spec_counters_from_the_metrics_page_and_whole_block_counts_agree():
    from dfp_dev.serving.vllm_server import SpecCounters, parse_spec_counters
    from dfp_trainer.evaluate.serve_reference import whole_block_counts

    counters = parse_spec_counters(METRICS)
    assert (counters.drafts, counters.draft_tokens, counters.accepted) == (31, 93, 7)
    assert counters.per_position == [4, 2, 1]
    delta = counters - SpecCounters(10, 30, 2, [1, 1])
    assert (delta.drafts, delta.accepted, delta.per_position) == (21, 5, [3, 1, 1])
    assert delta.acceptance_length == pytest.approx(1 + 5 / 21)
    # steps accepting 0, 0, 1 and 3 drafts of 3: 4 drafts, 4 accepted, position i accepted when k > i
    counts = whole_block_counts([[2, 1], [0, 0, 0, 1]])
    assert counts == {"drafts": 4, "accepted": 4, "per_position": [2, 1, 1], "acceptance_length": 2.0}


def test_spec_counters_read_samples_with_timestamps_escaped_label_values_and_typed_families():
    from dfp_dev.serving.vllm_server import parse_spec_counters
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    page = ('vllm:num_requests_running{model_name="a\\"b"} 3 1700000000000\n'
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="a\\"}b"} 5.0 1700000000000\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="x\\\\",position="1"} 2 1700000000000\n')
    counters = parse_spec_counters(page)
    assert counters.drafts == 5 and counters.per_position == [0, 2]
    # the page as prometheus_client (vLLM's exporter) writes it: HELP and TYPE lines, _created samples
    registry = CollectorRegistry()
    drafts = Counter("vllm:spec_decode_num_drafts", "drafts", ["engine", "model_name"], registry=registry)
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "per position",
                      ["engine", "model_name", "position"], registry=registry)
    for engine in ("0", "1"):
        drafts.labels(engine, 'say "hi"').inc(3)
        per_pos.labels(engine, "m", "0").inc(2)
    counters = parse_spec_counters(generate_latest(registry).decode())
    assert counters.drafts == 6 and counters.per_position == [4]
    with pytest.raises(ValueError):
        parse_spec_counters("<html><body>not found</body></html>")


def test_compare_names_the_first_differing_token_and_ignores_the_stop_token():
    from dfp_dev.serving.check import compare

    reference = {"stop_token_ids": [9], "prompts": [
        {"prompt_ids": [1, 2], "greedy_ids": [5, 6, 9], "speculative_ids": [5, 6, 9]},
        {"prompt_ids": [1, 3], "greedy_ids": [5, 6, 7], "speculative_ids": [5, 6, 7]}]}
    answers = [{"prompt_token_ids": [1, 2], "choices": [{"token_ids": [5, 6]}]},
               {"prompt_token_ids": [1, 3], "choices": [{"token_ids": [5, 8, 7]}]}]
    first, second = compare(reference, answers, ["a", "b"])
    assert first["output_equal"] and first["prompt_equal"] and first["first_difference"] is None
    assert not second["output_equal"] and second["first_difference"] == 1 and second["speculative_equal"]


def test_a_sliding_window_drafter_is_served_as_trained(vllm_python, servable_target, servable_dataset, tmp_path_factory,
                                                       tmp_path):
    """All layers sliding, window 3 < block 4: causal within the block and three positions of context, in
    training, in the project's decoding and in vLLM (its CPU runner serves all-sliding drafters; one that
    mixes sliding and full layers needs its V2 runner, which the CPU build lacks). Every draft counts equal."""
    drafter = _train_drafter(tmp_path_factory.mktemp("sliding-drafter"), servable_target, servable_dataset,
                             layer_types=["sliding_attention"], sliding_window=3)
    config = json.loads((drafter / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] and "is_causal" not in config
    assert config["dflash_config"]["swa_window_size"] == 3
    messages, ids = load_prompts(None, limit=4)
    for server in _serve(vllm_python, servable_target, drafter, tmp_path_factory.mktemp("vllm-sliding-logs")):
        result = run_check(ServeCheck(servable_target, drafter, messages, ids, MAX_NEW_TOKENS, False, tmp_path), server)
    print(json.dumps({k: result[k] for k in ("vllm", "project_whole_blocks", "project_tau")}))
    assert result["outputs_equal"] and all(r["speculative_equal"] for r in result["prompts"])
    vllm, project = result["vllm"], result["project_whole_blocks"]
    assert vllm["drafts"] == project["drafts"] > 0 and vllm["per_position"] == project["per_position"]
    assert result["acceptance_equal"]


def test_a_drafter_started_from_the_targets_layers_is_served_as_trained(vllm_python, servable_target, servable_dataset,
                                                                       tmp_path_factory, tmp_path):
    """``init: target_layers`` changes only the drafter's starting weights: the export is the same layout, and vLLM
    serves it with outputs equal to greedy and drafts equal to the project's decoder."""
    drafter = _train_drafter(tmp_path_factory.mktemp("target-layers-drafter"), servable_target, servable_dataset,
                             init="target_layers", num_draft_layers=2)
    messages, ids = load_prompts(None, limit=4)
    for server in _serve(vllm_python, servable_target, drafter, tmp_path_factory.mktemp("vllm-init-logs")):
        result = run_check(ServeCheck(servable_target, drafter, messages, ids, MAX_NEW_TOKENS, False, tmp_path), server)
    print(json.dumps({k: result[k] for k in ("vllm", "project_whole_blocks", "project_tau")}))
    _assert_served_as_the_project_drafts(result)
    assert result["outputs_equal"]


def test_a_drafter_of_a_llama_target_without_mask_token_is_served_as_trained(vllm_python, qwen3_tokenizer_dir,
                                                                             tmp_path_factory, tmp_path):
    """A Llama target shaped like SmolLM2 (tied embeddings, ChatML without thinking mode, no mask token): the
    trainer picks a spare special token as the mask, and vLLM's Llama model with the DFlash drafter serves
    outputs equal to greedy and drafts equal to the project's decoder."""
    from dfp_dev.targets.tiny import build_tiny_llama

    target = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-hd32"), qwen3_tokenizer_dir, hidden_size=64,
                              num_heads=2, num_kv_heads=1, head_dim=32)
    drafter = _train_drafter(tmp_path_factory.mktemp("llama-drafter"), target)
    config = json.loads((drafter / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] != json.loads((target / "config.json").read_text())["vocab_size"]
    messages, ids = load_prompts(None, limit=4)
    for server in _serve(vllm_python, target, drafter, tmp_path_factory.mktemp("vllm-llama-logs")):
        result = run_check(ServeCheck(target, drafter, messages, ids, MAX_NEW_TOKENS, False, tmp_path), server)
    print(json.dumps({k: result[k] for k in ("vllm", "project_whole_blocks", "project_tau")}))
    assert all(r["prompt_equal"] for r in result["prompts"])  # the target's own ChatML template
    assert result["outputs_equal"] and all(r["speculative_equal"] for r in result["prompts"])
    vllm, project = result["vllm"], result["project_whole_blocks"]
    assert vllm["drafts"] == project["drafts"] > 0 and vllm["per_position"] == project["per_position"]
    assert result["acceptance_equal"]
