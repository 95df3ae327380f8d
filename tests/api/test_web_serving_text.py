"""The job page shows only commands that are safe to paste: its serving text, run through ``bash -c``, passes
each hostile path as one argument and runs nothing of it; every output value reads as text.

The page's own functions are run in node (the page test in test_web_page.py needs chromium); the shell
commands they build are run by bash with ``vllm`` and ``tensorboard`` defined as functions that print
their arguments."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

APP_JS = Path(__file__).resolve().parents[2] / "services" / "dfp_api" / "web" / "app.js"
HOSTILE = [
    "/data/x'$(touch {marker})'y",
    "/data/a b/$(touch {marker})/`touch {marker}`",
    "/data/it's\n$(touch {marker})\n",
    "/data/\"quoted\" $HOME ; touch {marker} && echo \\ done",
    "/data/-plain.path_1",
]

pytestmark = pytest.mark.skipif(shutil.which("node") is None or shutil.which("bash") is None,
                                reason="needs node and bash")


def _page_functions(*names: str) -> str:
    source = APP_JS.read_text()
    out = []
    for name in names:
        match = re.search(rf"^function {name}\(.*?^}}$", source, flags=re.S | re.M)
        assert match, f"app.js has no function {name}"
        out.append(match.group(0))
    return "\n".join(out)


def _run_page(expression: str, **inputs) -> object:
    script = (_page_functions("shellQuote", "localPath", "servingText", "outputText")
              + f"\nconst inputs = {json.dumps(inputs)};\nprocess.stdout.write(JSON.stringify({expression}));")
    return json.loads(subprocess.run(["node", "-e", script], capture_output=True, text=True, check=True,
                                     timeout=20).stdout)


def _argv_of(command: str, tmp_path) -> list[list[str]]:
    """The arguments each line's command gets when the text is pasted into bash."""
    prelude = ("args() { printf '%s\\0' \"$@\"; printf '\\1'; }; vllm() { args \"$@\"; }; "
               "tensorboard() { args \"$@\"; }\n")
    out = subprocess.run(["bash", "-c", prelude + command], capture_output=True, check=True, cwd=tmp_path,
                         timeout=20).stdout.decode()
    return [call.split("\0")[:-1] for call in out.split("\1")[:-1]]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_serving_text_passes_hostile_paths_as_one_argument(tmp_path, hostile):
    marker = tmp_path / "pwned"
    path = hostile.format(marker=marker)
    spec = {"target": "file://" + path + "-target", "block_size": 8}
    outputs = {"drafter": "file://" + path + "/drafter", "tensorboard": "file://" + path + "/tb"}
    text = _run_page("servingText(inputs.spec, inputs.outputs)", spec=spec, outputs=outputs)
    calls = _argv_of(text, tmp_path)
    assert not marker.exists(), text
    assert calls[0][:2] == ["serve", path + "-target"] and calls[0][2] == "--speculative-config", calls
    assert json.loads(calls[0][3]) == {"method": "dflash", "model": path + "/drafter", "num_speculative_tokens": 7}
    assert calls[1] == ["--logdir", path + "/tb"]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_the_page_shows_the_trainer_s_own_quoted_command_when_the_job_has_one(tmp_path, hostile):
    marker = tmp_path / "pwned"
    path = hostile.format(marker=marker)
    config = json.dumps({"method": "dflash", "model": path + "/d", "num_speculative_tokens": 7})
    # as the trainer writes outputs.serving (shlex-quoted command lines, and a Python snippet beside them)
    serving = {"vllm": f"vllm serve {shlex.quote(path + '-target')} --speculative-config {shlex.quote(config)}",
               "transformers": "import torch"}
    text = _run_page("servingText(inputs.spec, inputs.outputs)", spec={"target": "/elsewhere"},
                     outputs={"drafter": "file://" + path + "/d", "serving": serving})
    assert text == serving["vllm"]
    calls = _argv_of(text, tmp_path)
    assert not marker.exists()
    assert calls[0][1] == path + "-target" and json.loads(calls[0][3])["model"] == path + "/d"


def test_every_output_value_reads_as_text():
    got = _run_page("[inputs.values.map(outputText)]",
                    values=["s3://b/x", ["a", "b"], {"vllm": "vllm serve x"}, [{"k": 1}], None, True])
    assert got == [["s3://b/x", "a, b", '{"vllm":"vllm serve x"}', '{"k":1}', "null", "true"]]
    assert not any("[object Object]" in v for v in got[0])
