"""``dflash-pipeline adapt rollback | history``: the served drafter restored byte for byte from the command line,
its history printed, the served location confined to the storage roots and the settings bounded."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from dfp_adapt.served_store import ServedDrafters
from dfp_cli.main import cli

from tests.shared.test_promotion import current_files, write_export


def test_rollback_restores_the_previous_drafter_and_history_shows_it(tmp_path):
    root = f"file://{tmp_path}"
    first = write_export(f"{root}/runs/1/drafter", 1)
    write_export(f"{root}/runs/2/drafter", 2, extra=True)
    served = ServedDrafters(f"{root}/served", "qwen3")
    served.promote(f"{root}/runs/1/drafter/", {"source_job": "a"})
    served.promote(f"{root}/runs/2/drafter/", {"source_job": "b"})
    env = {"DFLASH_STORAGE_URL": root, "DFLASH_ADAPT_NAME": "qwen3", "DFLASH_LOG_JSON": "false"}

    out = CliRunner().invoke(cli, ["adapt", "rollback", "--reason", "p99 latency up"], env=env)
    assert out.exit_code == 0, out.output
    event = json.loads(out.output)
    assert event["action"] == "rolled_back" and event["version"] == 1 and event["reason"] == "p99 latency up"
    assert current_files(served) == first

    out = CliRunner().invoke(cli, ["adapt", "history"], env=env)
    assert out.exit_code == 0, out.output
    history = json.loads(out.output)
    assert history["stack"] == [1] and [e["action"] for e in history["events"]] == ["promoted", "promoted",
                                                                                     "rolled_back"]
    again = CliRunner().invoke(cli, ["adapt", "rollback"], env=env)
    assert again.exit_code != 0 and "no earlier version to roll back to" in again.output
    assert current_files(served) == first


def test_the_served_location_is_confined_and_settings_bounded(tmp_path):
    env = {"DFLASH_STORAGE_URL": f"file://{tmp_path}/root", "DFLASH_ALLOWED_PREFIXES": ""}
    out = CliRunner().invoke(cli, ["adapt", "rollback", "--adapt-served", "file:///etc/served"], env=env)
    assert out.exit_code != 0 and "outside the allowed storage" in out.output
    for flag, value, name in [("--adapt-threshold", "-1", "--adapt-threshold"), ("--adapt-z", "11", "--adapt-z"),
                              ("--adapt-window-hours", "1000", "--adapt-window-hours"),
                              ("--adapt-heldout-share", "0.9", "--adapt-heldout-share"),
                              ("--adapt-name", "../x", "--adapt-name")]:
        out = CliRunner().invoke(cli, ["adapt", "history", flag, value], env=env)
        assert out.exit_code != 0 and name in out.output, (flag, out.output)
    assert "--api-key" not in CliRunner().invoke(cli, ["adapt", "run", "--help"]).output  # environment only


def test_a_run_needs_a_key_that_may_submit_jobs(make_app, redis_client, tmp_path):
    from .conftest import READ_KEY, served

    with served(make_app()) as port:
        env = {"DFLASH_STORAGE_URL": f"file://{tmp_path}", "DFLASH_API_URL": f"http://127.0.0.1:{port}",
               "DFLASH_API_KEY": READ_KEY, "DFLASH_LOG_JSON": "false"}
        out = CliRunner().invoke(cli, ["adapt", "run"], env=env)
    assert out.exit_code == 1 and "an adapt run needs a key with the write scope" in out.output
    assert not (tmp_path / "served").exists() and not (tmp_path / "adapt").exists()  # nothing claimed or written


def test_a_job_records_output_is_read_only_under_the_runs_own_prefix(tmp_path):
    from dfp_adapt.run import plan_run
    from dfp_adapt.settings import AdaptSettings
    from dfp_shared.storage.roots import OutsideRoots

    root = f"file://{tmp_path}"
    settings = AdaptSettings(storage_url=root, adapt_name="qwen3")
    plan = plan_run(settings, {}, "team-a")
    job = {"type": "pipeline", "outputs": {"drafter": plan.run + "train/drafter/"}}
    assert plan.output(job, "drafter", "train/").endswith("train/drafter/")
    # a job record pointing the promotion at another team's drafter (or the served store itself) is refused
    for elsewhere in (f"{root}/team-b/train/drafter/", plan.served.uri, plan.run + "generated/drafter/"):
        with pytest.raises(OutsideRoots, match="is not under"):
            plan.output({"type": "pipeline", "outputs": {"drafter": elsewhere}}, "drafter", "train/")


def test_a_run_whose_key_the_reservations_do_not_name_claims_nothing(tmp_path, monkeypatch):
    """The operator keeps the loop's prefixes for one key's principal: a run with another key is refused before it
    claims the served store (which would then stay held by the wrong principal)."""
    from datetime import datetime, timezone

    from dfp_adapt.run import plan_run
    from dfp_adapt.settings import AdaptSettings
    from dfp_shared.storage.ownership import MARKER
    from dfp_shared.storage.roots import OutsideRoots

    root = tmp_path / "root"
    monkeypatch.setenv("DFLASH_STORAGE_URL", f"file://{root}")
    monkeypatch.setenv("DFLASH_RESERVED_PREFIXES", json.dumps(
        {f"file://{root}/served": "adapt", f"file://{root}/adapt": "adapt", f"file://{root}/capture": ""}))
    when = datetime(2026, 3, 8, tzinfo=timezone.utc)
    with pytest.raises(OutsideRoots, match="adapt served location: .* kept for the jobs of 'adapt'"):
        plan_run(AdaptSettings(), {}, "ci-loop", when)
    assert not (root / "served" / "default" / MARKER).exists()
    plan = plan_run(AdaptSettings(), {}, "adapt", when)
    assert (root / "served" / "default" / MARKER).exists() and plan.run.startswith(f"file://{root}/adapt/default/")


def test_a_run_stopped_by_sigterm_mid_promotion_releases_the_served_store(tmp_path, monkeypatch):
    """The CronJob's deadline sends SIGTERM, most likely while the run's promotion copies: the run ends as failed
    and the served store's lock goes with it, so the next run (or a rollback) is not held off for hours."""
    import os
    import signal

    import dfp_adapt.run as adapt_run
    from dfp_adapt.served_store import LOCK

    served = ServedDrafters(f"file://{tmp_path}/served", "default")

    def promoting(jobs, settings, stages, now=None):
        with served._changing("promotion"):
            assert served.store.exists(LOCK)
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("not reached: the signal ends the run")

    monkeypatch.setattr(adapt_run, "adapt_once", promoting)
    before = signal.getsignal(signal.SIGTERM)
    out = CliRunner().invoke(cli, ["adapt", "run"], env={"DFLASH_STORAGE_URL": f"file://{tmp_path}",
                                                         "DFLASH_LOG_JSON": "false"})
    assert out.exit_code == 1 and f"stopped by signal {int(signal.SIGTERM)}" in out.output
    assert not served.store.exists(LOCK)
    assert signal.getsignal(signal.SIGTERM) is before
