"""The development commands the ``dflash-pipeline`` command offers where this package is installed.

Same shape as :data:`dfp_cli.main.COMMANDS`: name -> "module:attribute" of a click command, imported
only when the command runs.
"""

from __future__ import annotations

COMMANDS = {
    "demo": "dfp_dev.demo.command:demo",
    "serve-check": "dfp_dev.serving.check:serve_check",
    "build-target": "dfp_dev.targets.learnable:build_target",
}

HELP = {
    "demo": "Run the whole pipeline locally on the CPU with a tiny model.",
    "serve-check": "Serve an exported drafter with a real vLLM and check it against the project.",
    "build-target": "Build (once, then cached) a small Qwen3 target trained on the standard library.",
}
