"""The local end-to-end demo: every service as a local process, one pipeline job through the API.

Embedded defaults: a private Redis, ``file://`` storage under the output directory, a tiny
random-initialised Qwen3 target with the real Qwen3 tokenizer and chat template, and a built-in
prompt set. The services run exactly as in a cluster (API, generation worker, tokenizer pool,
gRPC target service, trainer worker), each in its own process; the demo submits a ``pipeline``
job over HTTP, shows live progress, and stops every process at the end (also on Ctrl-C).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
import shutil
import signal
import sys
import time
from importlib import resources
from pathlib import Path

from dfp_shared.signals import StopSignals, raise_keyboard_interrupt
from rich.console import Console

from ..local.processes import ProcessGroup
from ..local.redis_server import RedisServer, free_port, wait_for_port
from .config import DemoConfig

console = Console()


def service_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dfp_cli.main", *args]


TINY_HIDDEN = 64  # hidden size of the demo's tiny target


def tiny_target_heads(head_dim: int) -> dict:
    """Heads of the tiny target for a head size: hidden 64 split into heads (half as many KV heads)."""
    if head_dim not in (16, 32, 64):
        raise ValueError(f"--head-dim: expected 16, 32 or 64 (heads of the hidden size {TINY_HIDDEN}), got {head_dim}")
    heads = TINY_HIDDEN // head_dim
    return {"hidden_size": TINY_HIDDEN, "head_dim": head_dim, "num_heads": heads, "num_kv_heads": max(1, heads // 2)}


def tiny_target_name(head_dim: int, hybrid: bool = False) -> str:
    base = "tiny-qwen3_5" if hybrid else "tiny-qwen3"
    return base if head_dim == 16 else f"{base}-hd{head_dim}"


def prepare_inputs(cfg: DemoConfig, store_dir: Path) -> tuple[Path, Path]:
    """The target checkpoint and the prompt file, under the store."""
    from ..targets.qwen3_tokenizer import qwen3_tokenizer_dir
    from ..targets.tiny import build_tiny_llama, build_tiny_qwen3

    if cfg.target == "learnable":
        model_dir, source = learnable_target(store_dir)
        prompts = source.read_text(encoding="utf-8").splitlines()
    elif cfg.target == "llama":
        with console.status("fetching the Qwen3 tokenizer and building the tiny Llama target"):
            heads = {k: v for k, v in tiny_target_heads(cfg.head_dim).items() if k != "hidden_size"}
            model_dir = build_tiny_llama(store_dir / "models" / f"tiny-llama-hd{cfg.head_dim}", qwen3_tokenizer_dir(),
                                         hidden_size=TINY_HIDDEN, **heads)
        prompts = resources.files("dfp_dev.demo").joinpath("prompts.jsonl").read_text(encoding="utf-8").splitlines()
    else:
        with console.status("fetching the Qwen3 tokenizer and building the tiny target"):
            tok_dir = qwen3_tokenizer_dir()
            model_dir = build_tiny_qwen3(store_dir / "models" / tiny_target_name(cfg.head_dim, cfg.hybrid_target),
                                         tok_dir, hybrid=cfg.hybrid_target, **tiny_target_heads(cfg.head_dim))
        prompts = resources.files("dfp_dev.demo").joinpath("prompts.jsonl").read_text(encoding="utf-8").splitlines()
    prompt_file = store_dir / "prompts" / "demo.jsonl"
    prompt_file.parent.mkdir(parents=True, exist_ok=True)
    prompt_file.write_text("\n".join(prompts[: cfg.prompt_count()]) + "\n", encoding="utf-8")
    return model_dir, prompt_file


def learnable_target(store_dir: Path) -> tuple[Path, Path]:
    """The learnable target (built once per machine, in the cache) linked into the store, and its training-split
    prompts (the held-out split is never the demo's)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ..targets.learnable import build_learnable_target, default_root
    from ..targets.qwen3_tokenizer import qwen3_tokenizer_dir

    columns = (TextColumn("building the learnable target (once per machine)"), BarColumn(), MofNCompleteColumn(),
               TextColumn("steps, loss {task.fields[loss]:.2f}"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("target", total=None, loss=float("nan"))
        built = build_learnable_target(default_root(), qwen3_tokenizer_dir(), on_step=lambda step, total, loss: bar.update(
            task, completed=step, total=total, loss=loss))
    state = "from the cache" if built.hit else f"built in {built.info.get('build_seconds', 0):.0f}s"
    console.print(f"learnable target {built.path.name} ({state}; training loss {built.info.get('final_loss', 0):.2f})")
    model_dir = store_dir / "models" / built.path.name
    if not (model_dir / "config.json").exists():
        shutil.copytree(built.path, model_dir, copy_function=_link_or_copy, dirs_exist_ok=True)
    return model_dir, model_dir / "prompts" / "train.jsonl"


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system
        shutil.copy2(src, dst)


def pipeline_spec(cfg: DemoConfig, store_dir: Path, model_dir: Path, prompt_file: Path) -> dict:
    thinking = cfg.target != "llama"  # the Llama target's template has no thinking mode
    return {
        "type": "pipeline",
        "spec": {
            "generate": {"prompts": f"file://{prompt_file}", "output": f"file://{store_dir}/generate",
                         "model": f"file://{model_dir}", "engine": "transformers", "temperature": 0.0,
                         "max_new_tokens": cfg.max_new_tokens, "thinking": thinking, "shard_size": 16},
            "tokenize": {"output": f"file://{store_dir}/tokens", "tokenizer": f"file://{model_dir}",
                         "thinking": thinking, "max_length": 1024, "truncation": "truncate"},
            "train": {"target": f"file://{model_dir}", "output": f"file://{store_dir}/train",
                      # sized for 2 CPU cores: the 151k-entry LM head dominates, so few anchors per sequence
                      "steps": cfg.train_steps, "tokens_per_batch": 1024, "max_length": 256,
                      "num_draft_layers": cfg.draft_layers, "block_size": 8, "lr": 5e-3, "warmup_ratio": 0.05,
                      "max_anchors": 8, "checkpoint_every": 100, "eval_prompts": cfg.eval_prompts,
                      # a few mid-training points on the tau curve: held-out accuracy on 4 samples and the
                      # tau it predicts (the target is remote, so tau itself is measured at the end only)
                      "eval_every": max(1, cfg.train_steps // 6),
                      "eval_max_new_tokens": 32, "seed": 0, "enable_thinking": thinking},
        },
    }


def start_services(group: ProcessGroup, env: dict, model_dir: Path, api_port: int, target_port: int) -> None:
    group.start("api", service_cmd("api", "serve", "--host", "127.0.0.1", "--port", str(api_port)), env)
    group.start("target", service_cmd("target", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
                                      "--port", str(target_port)), env)
    group.start("generation", service_cmd("generation", "worker"), env)
    group.start("tokenizer", service_cmd("tokenizer", "worker", "--processes", "1"), env)
    group.start("trainer", service_cmd("trainer", "worker"), {**env, "DFLASH_TARGET_URL": f"127.0.0.1:{target_port}"})


def wait_ready(group: ProcessGroup, api_url: str, target_port: int, timeout: float = 180.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    with console.status("starting the services (api, target, generation, tokenizer, trainer)"):
        while True:
            group.check_alive()
            try:
                if httpx.get(f"{api_url}/readyz", timeout=2).status_code == 200:
                    wait_for_port(target_port, timeout=max(1.0, deadline - time.monotonic()))
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("services did not become ready in time")
            time.sleep(0.5)


def run_demo(cfg: DemoConfig) -> int:
    """Run the pipeline end to end; returns the process exit code."""
    from dfp_cli.client_view import stage_records, watch_job
    from dfp_shared.api_client import Api

    out = cfg.out_dir.resolve()
    if cfg.fresh and out.exists():
        shutil.rmtree(out)
    store_dir, logs_dir = out / "store", out / "logs"
    store_dir.mkdir(parents=True, exist_ok=True)
    model_dir, prompt_file = prepare_inputs(cfg, store_dir)

    redis = RedisServer(appendonly=True, data_dir=str(out / "redis")).start()
    api_key = secrets.token_urlsafe(24)
    api_port, target_port = free_port(), free_port()
    api_url = f"http://127.0.0.1:{api_port}"
    services_path = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "DFLASH_REDIS_URL": redis.url, "DFLASH_STORAGE_URL": f"file://{store_dir}",
           "DFLASH_API_KEYS": json.dumps([{"name": "demo", "sha256": hashlib.sha256(api_key.encode()).hexdigest(),
                                           "scopes": ["read", "write"]}]),
           "DFLASH_LOG_LEVEL": "INFO", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (services_path, os.environ.get("PYTHONPATH", "")) if p)}
    group = ProcessGroup(logs_dir)
    # `kill` and `timeout` stop the services like Ctrl-C does
    StopSignals(raise_keyboard_interrupt, signals=(signal.SIGTERM,)).install()
    try:
        start_services(group, env, model_dir, api_port, target_port)
        wait_ready(group, api_url, target_port)
        api = Api(api_url, api_key)
        job = api.call("POST", "/v1/jobs", json=pipeline_spec(cfg, store_dir, model_dir, prompt_file),
                       headers={"Idempotency-Key": f"demo-{out}"}).json()
        console.print(f"submitted pipeline job [bold]{job['id']}[/bold] to {api_url}")
        code = watch_job(api, job["id"])
        final = api.call("GET", f"/v1/jobs/{job['id']}").json()
        stages = stage_records(api, final)
        summarise(final, stages, out)
        return code
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping every service[/yellow]")
        return 130
    except Exception as exc:  # noqa: BLE001 - report, then stop every process
        console.print(f"[red]demo failed: {exc}[/red]")
        for name, mp in group.procs.items():
            if not mp.alive() and name not in str(exc):
                console.print(f"[red]{name} exited[/red]; last log lines:\n{mp.log_tail(20)}")
        console.print(f"service logs: {logs_dir}")
        return 1
    finally:
        with console.status("stopping the services"):
            group.stop_all()
            redis.stop()


def prediction_line(train: dict) -> str:
    """The τ the held-out accuracies predict beside the measured one, and the train/serve verdict."""
    noise = f" ± {train['tau_gap_noise']:.2f}" if train.get("tau_gap_noise") is not None else ""
    verdict = ("[red]train/serve mismatch[/red]: " + train["mismatch_reason"] if train.get("train_serve_mismatch")
               else "no train/serve mismatch")
    return (f"predicted from held-out accuracy: {train['tau_predicted']:.2f} (gap {train['tau_gap']:+.2f}{noise}); "
            f"{verdict}")


def summarise(final: dict, stages: dict, out: Path) -> None:
    """Where everything is, the headline numbers, and the commands to look at each."""
    train = stages.get("train", {}).get("outputs", {})
    console.rule("dflash-pipeline demo: results")
    for name, record in stages.items():
        units = record["progress"]["units"]
        counts = ", ".join(f"{u} {v['done']:,.4g}" for u, v in units.items())
        console.print(f"{name:>9}: {record['state']} in {record['progress']['elapsed_s']:.0f}s ({counts})")
    if train.get("tau_trained") is not None:
        ngram = f", n-gram speculation {train['tau_ngram']:.2f}" if train.get("tau_ngram") is not None else ""
        console.print(f"acceptance length tau: trained [bold]{train['tau_trained']:.2f}[/bold] "
                      f"vs untrained {train['tau_untrained']:.2f}{ngram} (tokens per draft-verify step)")
        if train.get("tau_predicted") is not None:
            console.print(prediction_line(train))
    paths = {"completions": stages.get("generate", {}).get("outputs", {}).get("completions"),
             "token shards": stages.get("tokenize", {}).get("outputs", {}).get("dataset"),
             "drafter export": train.get("drafter"), "speculators export": train.get("drafter_speculators"),
             "report": train.get("report"),
             "plots": ", ".join(train.get("plots") or []), "logs": f"file://{out}/logs"}
    for name, uri in paths.items():
        if uri:
            console.print(f"{name:>15}: {uri}", markup=False)
    console.print("\nlook at them:")
    store = out / "store"
    look = [["head", "-c", "800", f"{store}/generate/completions/shard-00000.jsonl"],
            ["cat", f"{store}/tokens/manifest.json", f"{store}/tokens/stats.json"]]
    if train.get("drafter"):
        look.append(["cat", f"{train['drafter'].removeprefix('file://').rstrip('/')}/config.json"])
    if train.get("report"):
        look.append(["cat", train["report"].removeprefix("file://")])
    look += [["xdg-open", plot.removeprefix("file://")] for plot in train.get("plots") or []]
    for argv in look:  # each value quoted for the shell: a path is one word when pasted
        console.print(f"  {shlex.join(argv)}", markup=False, highlight=False, soft_wrap=True)
    serving = train.get("serving") or {}
    if serving:
        console.print("\nserve the drafter (a real GPU serving machine; the commands are also in the report):")
        for engine in ("vllm", "vllm_speculators", "sglang"):
            if serving.get(engine):
                console.print(f"  {serving[engine]}", markup=False, highlight=False, soft_wrap=True)
        console.print("load it with transformers:")
        console.print(serving["transformers"], markup=False, highlight=False, soft_wrap=True)
