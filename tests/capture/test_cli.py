"""``dflash-pipeline capture serve``: settings from flags and ``DFLASH_CAPTURE_*``, refused when bad."""

from __future__ import annotations

from click.testing import CliRunner
from dfp_cli.main import cli


def test_serve_takes_the_upstream_flag_and_its_variables():
    out = CliRunner().invoke(cli, ["capture", "serve", "--help"])
    assert out.exit_code == 0, out.output
    for flag in ("--upstream", "--capture-enabled", "--capture-sample-rate", "--capture-redact",
                 "--capture-retention-hours", "DFLASH_CAPTURE_HEADER"):
        assert flag in out.output


def test_bad_settings_are_refused_naming_them(tmp_path):
    out = CliRunner().invoke(cli, ["capture", "serve", "--upstream", "http://127.0.0.1:1"],
                             env={"DFLASH_CAPTURE_SAMPLE_RATE": "2"})
    assert out.exit_code != 0 and "DFLASH_CAPTURE_SAMPLE_RATE" in out.output
    out = CliRunner().invoke(cli, ["capture", "serve", "--upstream", "not a url"])
    assert out.exit_code != 0 and "--capture-upstream" in out.output
    outside = CliRunner().invoke(cli, ["capture", "serve", "--storage-url", f"file://{tmp_path}/root",
                                       "--capture-prefix", "file:///etc/capture"], env={"DFLASH_ALLOWED_PREFIXES": ""})
    assert outside.exit_code != 0 and "outside the allowed storage" in outside.output
