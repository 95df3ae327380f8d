"""``dflash-pipeline serve-check``: the exported drafter served by a real vLLM, checked against the project.

Starts vLLM's OpenAI server (from its own cached environment, :mod:`dfp_dev.serving.vllm_env`) for the target
with the drafter as its speculator (method ``dflash``, or ``dspark`` for a DSpark drafter; DSpark and DFlash2
drafters in vLLM's V2 model runner;
``num_speculative_tokens`` = block size - 1), sends every prompt
through ``/v1/chat/completions`` greedily in the drafter's thinking mode, and checks each output token
for token against the project's plain greedy decode (``dflash-pipeline trainer reference-decode``).
vLLM's acceptance counters come from its ``/metrics``; the acceptance length it implies (whole verified
blocks: 1 + accepted drafts / drafts) is printed beside the project's count of the same drafter and
prompts, counted both vLLM's way and the project's (τ of the trainer's report: the last block cut at
the token budget). The server's process group is stopped at the end. Exit status 1 when an output differs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import click
import httpx
from dfp_trainer.drafter.family import DrafterFamily, family, family_of_architectures

from ..demo.config import RANDOM_TARGET_PROMPTS
from .vllm_server import VllmServer, check_servable

EXIT_DIFFERENT = 1


@dataclass
class ServeCheck:
    target: Path
    drafter: Path
    prompts: list[list[dict]]
    prompt_ids: list[str]
    max_new_tokens: int
    enable_thinking: bool
    work_dir: Path


def _drafter_config(drafter: Path) -> tuple[Path, dict]:
    path = drafter / "config.json"
    try:
        return path, json.loads(path.read_text())
    except FileNotFoundError:
        raise click.UsageError(f"{path}: missing; --drafter must be an exported drafter directory") from None
    except json.JSONDecodeError as exc:
        raise click.UsageError(f"{path}: line {exc.lineno}: invalid JSON: {exc.msg}") from None


def drafter_method(drafter: Path) -> str:
    """vLLM's speculative method for the drafter, from its ``config.json``: ``dspark`` for a DSpark drafter
    (``architectures: ["Qwen3DSparkModel"]``), else ``dflash`` (a DFlash2 drafter too: vLLM tells it by its
    architecture)."""
    return drafter_family(drafter).serving_method


def drafter_family(drafter: Path) -> DrafterFamily:
    """The drafter's family, told by the ``architectures`` of its ``config.json`` (none known: DFlash)."""
    path, config = _drafter_config(drafter)
    try:
        return family_of_architectures(config.get("architectures") or [], str(path))
    except ValueError:
        return family("dflash")


def drafter_needs_v2_runner(drafter: Path) -> bool:
    """Whether vLLM drafts the drafter in its V2 model runner only: DSpark, and DFlash2 (its V1 runner refuses
    ``DFlash candidate-head drafts``)."""
    return not drafter_family(drafter).reference_route


def drafter_block_size(drafter: Path) -> int:
    """The drafter's block size from its ``config.json`` (``dflash_config.block_size``, else ``block_size``)."""
    path, config = _drafter_config(drafter)
    block = (config.get("dflash_config") or {}).get("block_size", config.get("block_size"))
    if not isinstance(block, int) or block < 2:
        raise click.UsageError(f"{path}: dflash_config.block_size: expected an integer >= 2, got {block!r}")
    return block


def drafter_thinking(drafter: Path) -> bool | None:
    """The thinking mode the drafter was trained in, from the training report beside its directory."""
    report = drafter.parent / "report.json"
    try:
        value = json.loads(report.read_text()).get("enable_thinking")
    except (FileNotFoundError, json.JSONDecodeError, AttributeError):
        return None
    return value if isinstance(value, bool) else None


def load_prompts(prompts: str | None, limit: int, target: Path | None = None) -> tuple[list[list[dict]], list[str]]:
    """Messages and ids of the prompts: a JSONL prompt set, or by default the demo's held-out prompts: the
    learnable target's held-out split (beside its weights), else those of the built-in set that
    ``dflash-pipeline demo`` does not train on a random target with."""
    from dfp_shared.records.prompts import read_prompt_set
    from dfp_shared.storage.store import StorageError

    skip = 0
    if prompts is None and target is not None and (target / "prompts" / "held-out.jsonl").is_file():
        prompts = str(target / "prompts" / "held-out.jsonl")
    elif prompts is None:
        prompts = str(resources.files("dfp_dev.demo").joinpath("prompts.jsonl"))
        skip = RANDOM_TARGET_PROMPTS
    try:
        found, errors = read_prompt_set(prompts, limit=skip + limit)
    except StorageError as exc:
        raise click.UsageError(f"--prompts: {exc}") from None
    if errors:
        first = errors[0]
        raise click.UsageError(f"{first.file}: line {first.line}: {first.reason}"
                               + (f" (and {len(errors) - 1} more bad lines)" if len(errors) > 1 else ""))
    found = found[skip:]
    if not found:
        raise click.UsageError(f"{prompts}: no prompts")
    return [p.messages for p in found], [p.id for p in found]


def reference_cmd(check: ServeCheck, prompts_file: Path, out_file: Path) -> list[str]:
    return [sys.executable, "-m", "dfp_cli.main", "trainer", "reference-decode", "--target", str(check.target),
            "--drafter", str(check.drafter), "--prompts", str(prompts_file), "--max-new-tokens",
            str(check.max_new_tokens), "--thinking" if check.enable_thinking else "--no-thinking",
            "--out", str(out_file)]


def _trim(ids: list[int], stops: set[int]) -> list[int]:
    """Up to the first stop token, without it (engines differ in whether they return it)."""
    for i, tok in enumerate(ids):
        if tok in stops:
            return ids[:i]
    return ids


def chat(client: httpx.Client, model: str, messages: list[dict], check: ServeCheck, stops: list[int]) -> dict:
    body = {"model": model, "messages": messages, "temperature": 0.0, "max_tokens": check.max_new_tokens,
            "seed": 0, "return_token_ids": True, "skip_special_tokens": False, "stop_token_ids": stops,
            "chat_template_kwargs": {"enable_thinking": check.enable_thinking}}
    resp = client.post("/v1/chat/completions", json=body)
    if resp.status_code != 200:
        raise click.ClickException(f"vLLM answered {resp.status_code}: {resp.text[:500]}")
    return resp.json()


def compare(reference: dict, answers: list[dict], ids: list[str]) -> list[dict]:
    """Per prompt: whether vLLM's prompt and output token ids equal the project's."""
    stops = set(reference["stop_token_ids"])
    rows = []
    for pid, ref, answer in zip(ids, reference["prompts"], answers):
        served = _trim(answer["choices"][0].get("token_ids") or [], stops)
        greedy = _trim(ref["greedy_ids"], stops)
        first = next((i for i, (a, b) in enumerate(zip(served, greedy)) if a != b), min(len(served), len(greedy)))
        rows.append({"id": pid, "prompt_equal": answer.get("prompt_token_ids") == ref["prompt_ids"],
                     "output_equal": served == greedy, "served_tokens": len(served), "greedy_tokens": len(greedy),
                     "first_difference": None if served == greedy else first,
                     "speculative_equal": _trim(ref["speculative_ids"], stops) == greedy})
    return rows


def reference_decode(check: ServeCheck) -> dict:
    """The project's plain greedy outputs and acceptance counts for the check's prompts (a subprocess)."""
    prompts_file, ref_file = check.work_dir / "prompts.json", check.work_dir / "reference.json"
    prompts_file.write_text(json.dumps(check.prompts))
    services = str(Path(__file__).resolve().parents[1])  # this code's own services, also in the subprocess
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (services, os.environ.get("PYTHONPATH")) if p),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    subprocess.run(reference_cmd(check, prompts_file, ref_file), check=True, stdin=subprocess.DEVNULL, env=env)
    return json.loads(ref_file.read_text())


def run_check(check: ServeCheck, server: VllmServer, reference: dict | None = None) -> dict:
    """Send the prompts to a started ``server`` and compare with the project's reference decode."""
    reference = reference if reference is not None else reference_decode(check)
    with httpx.Client(base_url=server.base_url, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        before = server.spec_counters()
        answers = [chat(client, model, messages, check, reference["stop_token_ids"]) for messages in check.prompts]
        counters = server.spec_counters() - before
    rows = compare(reference, answers, check.prompt_ids)
    project = reference["whole_blocks"]
    return {"prompts": rows, "outputs_equal": all(r["output_equal"] and r["prompt_equal"] for r in rows),
            "vllm": {"acceptance_length": counters.acceptance_length, "drafts": counters.drafts,
                     "accepted": counters.accepted, "draft_tokens": counters.draft_tokens,
                     "per_position": counters.per_position},
            "project_whole_blocks": project, "project_tau": reference["tau"], "project_steps": reference["steps"],
            "acceptance_equal": (counters.drafts, counters.accepted, counters.per_position)
            == (project["drafts"], project["accepted"], [float(x) for x in project["per_position"]]),
            "block_size": reference["block_size"], "enable_thinking": check.enable_thinking,
            "max_new_tokens": check.max_new_tokens}


def print_result(result: dict, echo=click.echo) -> None:
    for row in result["prompts"]:
        mark = "same" if row["output_equal"] and row["prompt_equal"] else "DIFFERENT"
        extra = "" if row["prompt_equal"] else " (prompt tokens differ)"
        if row["first_difference"] is not None:
            extra += f" (first difference at output token {row['first_difference']})"
        echo(f"  {row['id']}: {mark}: {row['served_tokens']} tokens served, {row['greedy_tokens']} greedy{extra}")
    v, p = result["vllm"], result["project_whole_blocks"]
    n = len(result["prompts"])
    echo(f"outputs: {sum(r['output_equal'] and r['prompt_equal'] for r in result['prompts'])}/{n} prompts equal "
         "plain greedy token for token")
    echo(f"acceptance length, whole verified blocks (vLLM's count): vLLM {v['acceptance_length']:.3f} "
         f"({v['accepted']:.0f} accepted / {v['drafts']:.0f} drafts); project {p['acceptance_length']:.3f} "
         f"({p['accepted']} / {p['drafts']}): {'equal' if result['acceptance_equal'] else 'DIFFERENT'}")
    echo(f"  accepted per draft position: vLLM {[int(x) for x in v['per_position']]}, project {p['per_position']}")
    echo(f"project's tau (last block cut at the token budget, as the trainer's report counts it): "
         f"{result['project_tau']:.3f} over {result['project_steps']} verify steps")


@click.command(name="serve-check")
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Target model directory (Hugging Face checkpoint with its tokenizer).")
@click.option("--drafter", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Exported drafter directory (z-lab layout: config.json, model.safetensors).")
@click.option("--prompts", default=None, help="Prompt JSONL file or prefix [default: the demo's held-out prompts].")
@click.option("--limit", type=click.IntRange(1, 1000), default=8, show_default=True, help="Prompts to run.")
@click.option("--max-new-tokens", type=click.IntRange(1, 1024), default=32, show_default=True,
              help="Tokens generated per prompt.")
@click.option("--thinking/--no-thinking", default=None,
              help="Thinking mode of the chat template [default: the drafter's training report's, else on].")
@click.option("--vllm-python", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Interpreter of an existing vLLM environment [default: the cached one, installed when missing].")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory for the server log and the results [default: a temporary one].")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the result as JSON here.")
def serve_check(target, drafter, prompts, limit, max_new_tokens, thinking, vllm_python, work_dir, json_out):
    """Serve the exported drafter with a real vLLM (DFlash or DSpark speculative decoding, from its config) and check it.

    Every output must equal the target's plain greedy decode token for token (exit status 1 if not);
    vLLM's acceptance length is printed beside the project's for the same drafter and prompts.
    """
    from .vllm_env import VllmInstallError, ensure_env

    block = drafter_block_size(drafter)
    try:
        check_servable(target, "target")
        check_servable(drafter, "drafter")
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if thinking is None:
        thinking = drafter_thinking(drafter)
        thinking = True if thinking is None else thinking
    messages, ids = load_prompts(prompts, limit, target)
    work = work_dir or Path(tempfile.mkdtemp(prefix="dfp-serve-check-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        python = vllm_python or ensure_env(echo=click.echo)
    except VllmInstallError as exc:
        raise click.ClickException(f"cannot install vLLM: {exc}") from None
    check = ServeCheck(target.resolve(), drafter.resolve(), messages, ids, max_new_tokens, thinking, work)
    method = drafter_method(drafter)
    server = VllmServer(python, check.target, work, drafter_dir=check.drafter, num_speculative_tokens=block - 1,
                        method=method, v2_runner=drafter_needs_v2_runner(drafter))
    kind = drafter_family(drafter).name
    click.echo(f"starting vLLM ({python}) for {check.target} with the {kind} drafter {check.drafter} "
               f"(block {block}, {block - 1} speculative tokens, thinking {'on' if thinking else 'off'}); "
               f"log {server.log_path}")
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:  # the project's decode runs while vLLM starts
        reference = pool.submit(reference_decode, check)
        try:
            server.start()
            click.echo(f"vLLM ready in {time.monotonic() - started:.0f}s on {server.base_url}; "
                       f"{len(messages)} prompts, {max_new_tokens} tokens each")
            result = run_check(check, server, reference.result())
        except (RuntimeError, TimeoutError, httpx.HTTPError, subprocess.CalledProcessError) as exc:
            raise click.ClickException(f"{exc}\n{server.log_tail(20)}") from None
        finally:
            server.stop()
    print_result(result)
    if json_out:
        json_out.write_text(json.dumps(result, indent=1))
    raise SystemExit(0 if result["outputs_equal"] else EXIT_DIFFERENT)
