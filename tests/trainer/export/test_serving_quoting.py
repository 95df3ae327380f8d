"""Every command line and snippet the project prints for pasting keeps a hostile path one literal: the shell
lines run (with stand-in ``vllm`` and ``python`` programs) and receive the path as one argument, running
nothing else; the Python snippet parses with the path as one string constant."""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from dfp_dev.demo import run as demo
from dfp_trainer.export.serving import serving_commands

from tests.trainer.drafter_support import small_config

HOSTILE = "/models/x\"; touch PWNED-dq; '$(touch PWNED-sub)`touch PWNED-bq`'\nhalf\" + __import__('os').system('touch PWNED-py') + \""


def _stand_ins(tmp_path: Path) -> Path:
    """``vllm`` and ``python`` that record their arguments (one JSON list a line) instead of serving."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("vllm", "python"):
        prog = bin_dir / name
        prog.write_text(f"#!{os.sys.executable}\nimport json, sys\n"
                        f"open({str(tmp_path / 'argv.jsonl')!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
        prog.chmod(0o755)
    return bin_dir


def _run_shell(line: str, tmp_path: Path) -> list[list[str]]:
    assert subprocess.run(["bash", "-n", "-c", line], capture_output=True).returncode == 0, line
    env = {"PATH": f"{_stand_ins(tmp_path)}:/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert not list(tmp_path.glob("PWNED*")), (line, done.stderr)
    return [json.loads(row) for row in (tmp_path / "argv.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family", ["dflash", "dflash2"])
def test_a_hostile_path_in_every_serving_line_runs_nothing(tmp_path, family):
    extra = {"conv_kernel_size": 2, "conv_group_size": 4, "selector_rank": 4, "selector_top_k": 4} \
        if family == "dflash2" else {}
    commands = serving_commands(small_config(**extra), f"file://{HOSTILE}/t", f"{HOSTILE}/d", f"{HOSTILE}/s")
    for engine in ("vllm", "sglang", "vllm_speculators"):
        if engine not in commands:
            continue
        work = tmp_path / f"{family}-{engine}"
        work.mkdir()
        (argv,) = _run_shell(commands[engine], work)
        assert argv[:2] in (["serve", f"{HOSTILE}/t"], ["serve", f"{HOSTILE}/s"], ["-m", "sglang.launch_server"])
        if engine == "vllm":
            assert json.loads(argv[argv.index("--speculative-config") + 1])["model"] == f"{HOSTILE}/d"
        if engine == "sglang":
            assert argv[argv.index("--model-path") + 1] == f"{HOSTILE}/t"
            assert argv[argv.index("--speculative-draft-model-path") + 1] == f"{HOSTILE}/d"
    if "transformers" in commands:
        _assert_python_literals(commands["transformers"], {f"{HOSTILE}/d", f"{HOSTILE}/t"})


def _assert_python_literals(snippet: str, paths: set[str]) -> None:
    tree = ast.parse(snippet)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "from_pretrained"]
    assert len(calls) == 2
    assert {c.args[0].value for c in calls if isinstance(c.args[0], ast.Constant)} == paths
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "__import__" not in names


def test_the_demo_summary_quotes_every_path_it_prints(tmp_path):
    out = tmp_path / HOSTILE.replace("/", "_")
    serving = serving_commands(small_config(), f"file://{HOSTILE}/t", f"file://{HOSTILE}/d")
    record = {"state": "succeeded", "progress": {"units": {"steps": {"done": 1}}, "elapsed_s": 1.0}}
    train = {"drafter": f"file://{HOSTILE}/d/", "report": f"file://{HOSTILE}/report.json",
             "plots": [f"file://{HOSTILE}/loss.png"], "serving": serving}
    with demo.console.capture() as captured:
        demo.summarise({}, {"train": {**record, "outputs": train}}, out)
    text = captured.get()
    look = text.split("look at them:\n", 1)[1].split("\nserve the drafter", 1)[0]
    words = [shlex.split(line) for line in look.split("\n  ") if line.strip()]
    assert ["cat", f"{HOSTILE}/d/config.json"] in words and ["xdg-open", f"{HOSTILE}/loss.png"] in words
    assert ["cat", f"{HOSTILE}/report.json"] in words
    _assert_python_literals(text.split("load it with transformers:\n", 1)[1], {f"{HOSTILE}/d", f"{HOSTILE}/t"})
