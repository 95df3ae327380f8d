"""The umbrella command offers dfp_dev's commands where dfp_dev is installed, and works without it (the images)."""

from __future__ import annotations

import sys

from click.testing import CliRunner
from dfp_cli.main import cli
from dfp_dev.commands import COMMANDS, HELP

CLIENT_AND_SERVICES = ("api", "generation", "tokenizer", "target", "trainer", "capture", "submit", "jobs", "status", "cancel")


def test_the_development_commands_are_offered_with_their_help():
    assert set(COMMANDS) == set(HELP) == {"demo", "serve-check", "build-target"}
    out = CliRunner().invoke(cli, ["--help"])
    assert out.exit_code == 0, out.output
    for name in (*CLIENT_AND_SERVICES, *COMMANDS):
        assert name in out.output
    assert HELP["demo"] in out.output
    demo = CliRunner().invoke(cli, ["demo", "--help"])
    assert demo.exit_code == 0 and "--out" in demo.output and "--target" in demo.output, demo.output


def test_without_dfp_dev_the_client_and_services_remain(monkeypatch):
    # as where the package is not installed (the images): its entry point is in the metadata, its modules are gone
    monkeypatch.setitem(sys.modules, "dfp_dev", None)
    monkeypatch.setitem(sys.modules, "dfp_dev.commands", None)
    out = CliRunner().invoke(cli, ["--help"])
    assert out.exit_code == 0, out.output
    for name in CLIENT_AND_SERVICES:
        assert name in out.output
    for name in COMMANDS:
        assert name not in out.output
    missing = CliRunner().invoke(cli, ["demo"])
    assert missing.exit_code != 0 and "No such command 'demo'" in missing.output
    assert CliRunner().invoke(cli, ["submit", "--help"]).exit_code == 0
