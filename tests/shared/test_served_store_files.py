"""The served store's own files, as anyone who can write the store may leave them: a lock that can no longer be
right clears itself or is refused with its reason and a way out, never for good; a folder under ``versions/``
that is no version number is skipped; nothing read from them reaches a message with its control characters."""

from __future__ import annotations

import hashlib
import json
import logging

import dfp_adapt.served_store as promotion
import pytest
from dfp_adapt.served_store import LOCK, LOCKS, PromotionError, ServedDrafters

from tests.shared.test_promotion import write_export

ESCAPES = "\x1b]0;owned\x07\x1b[2J\x1b[31m\u202e\x9b"


def served_with(tmp_path, name: str = "d", endpoint: str | None = None, root: str | None = None) -> ServedDrafters:
    return ServedDrafters(f"{root or f'file://{tmp_path}'}/served", name, endpoint)


def lock(since: float, host: str = "gone", token: str = "t") -> bytes:
    return json.dumps({"action": "promotion", "host": host, "pid": 1, "since": since, "token": token}).encode()


def mark_of(raw: bytes) -> str:
    return f"{LOCKS}takeover-{hashlib.sha256(raw).hexdigest()[:32]}.json"


def test_a_lock_holder_s_escapes_never_reach_the_message(tmp_path):
    import time

    served = served_with(tmp_path)
    served.store.put(LOCK, json.dumps({"action": "roll" + ESCAPES, "host": "h" + ESCAPES, "pid": ESCAPES,
                                       "since": time.time()}).encode())
    with pytest.raises(PromotionError, match="in progress") as err:
        served.record({"action": "refused"})
    assert not any(c in str(err.value) for c in "\x1b\x07\u202e\x9b\n"), repr(str(err.value))


def test_a_takeover_mark_left_by_a_change_that_died_midway_is_stepped_over_once_stale(tmp_path, monkeypatch):
    """A change that found a stale lock, made its takeover mark and died before replacing the lock left both: once
    the mark is older than a takeover can take, the next change takes the lock over and clears the marks."""
    served = served_with(tmp_path)
    stale = lock(1_000.0)
    served.store.put(LOCK, stale)
    served.store.put(mark_of(stale), lock(1_000.0 + promotion.LOCK_TTL_S + 10, token="died"))
    monkeypatch.setattr(promotion.time, "time", lambda: 1_000.0 + promotion.LOCK_TTL_S + 20)
    with pytest.raises(PromotionError, match="taking over a stale lock"):  # it may still be at it
        served.record({"action": "refused"})
    monkeypatch.setattr(promotion.time, "time", lambda: 1_000.0 + promotion.LOCK_TTL_S + 20 + promotion.MARK_TTL_S)
    assert served.record({"action": "refused"})["action"] == "refused"
    assert not served.store.exists(LOCK) and not list(served.store.list(LOCKS))


def test_of_two_that_step_over_one_dead_mark_only_one_takes_the_lock(tmp_path, monkeypatch):
    a, b = served_with(tmp_path), served_with(tmp_path)
    stale = lock(0.0)
    a.store.put(LOCK, stale)
    a.store.put(mark_of(stale), lock(0.0, token="died"))
    with a._changing("rollback"):
        with pytest.raises(PromotionError, match="in progress"):
            b.record({"action": "refused"})
        # b read the stale lock before a replaced it: the next mark after the dead one is a's, so b stops there
        assert not b.store.put_if_absent(mark_of(stale)[:-len(".json")] + "-1.json", b"b")
    assert not a.store.exists(LOCK) and not list(a.store.list(LOCKS))


@pytest.mark.parametrize("leftover", ["unreadable", "no lock"])
def test_marks_of_locks_long_gone_are_cleared(tmp_path, leftover):
    served = served_with(tmp_path)
    served.store.put(mark_of(b"x"), b"\x00" if leftover == "unreadable" else lock(0.0))
    served.store.put(f"{LOCKS}takeover-{'0' * 32}-3.json", lock(1e12))  # dated impossibly
    assert served.record({"action": "refused"})["action"] == "refused"
    assert not list(served.store.list(LOCKS))


def test_a_lock_that_is_a_directory_is_refused_with_its_reason_and_way_out(tmp_path):
    served = served_with(tmp_path)
    (tmp_path / "served" / "d" / LOCK).mkdir(parents=True)
    (tmp_path / "served" / "d" / LOCK / "x").write_text("x")
    with pytest.raises(PromotionError, match=r"lock.json is no lock .*remove it") as err:
        served.record({"action": "refused"})
    assert "try again" not in str(err.value)
    (tmp_path / "served" / "d" / LOCK / "x").unlink()
    (tmp_path / "served" / "d" / LOCK).rmdir()
    assert served.record({"action": "refused"})["action"] == "refused"


def test_a_lock_folder_on_s3_holds_nothing(s3_server, s3_bucket):
    served = served_with(None, endpoint=s3_server.endpoint_url, root=s3_bucket)
    served.store.put(f"{LOCK}/x", b"x")
    assert served.record({"action": "refused"})["action"] == "refused"


@pytest.mark.parametrize("folder", ["²", "٣", "1x", "１２", "9" * 40])
def test_version_folders_that_are_no_ascii_number_are_skipped_with_a_warning(tmp_path, caplog, folder):
    write_export(f"file://{tmp_path}/c1", 1)
    served = served_with(tmp_path)
    served.store.put(f"versions/{folder}/config.json", b"{}")
    served.store.put("versions/4/config.json", b"{}")  # a promotion that died midway: a number, never served
    with caplog.at_level(logging.WARNING, logger="dfp_adapt.served_store"):
        assert served.promote(f"file://{tmp_path}/c1/", {})["version"] == 5
    assert any("no version number" in r.getMessage() for r in caplog.records)
    assert served.current().version == 5


def test_a_history_s_escapes_stay_escaped_when_printed(tmp_path):
    from click.testing import CliRunner
    from dfp_cli.main import cli

    served = served_with(tmp_path)
    served.record({"action": "refused", "reason": ESCAPES})
    out = CliRunner().invoke(cli, ["adapt", "history"], env={"DFLASH_STORAGE_URL": f"file://{tmp_path}",
                                                              "DFLASH_ADAPT_NAME": "d", "DFLASH_LOG_JSON": "false"})
    assert out.exit_code == 0 and not any(c in out.output for c in "\x1b\x07\u202e\x9b")


def test_the_rollback_command_prints_a_lock_holder_without_its_escapes(tmp_path):
    import time

    from click.testing import CliRunner
    from dfp_cli.main import cli

    served = served_with(tmp_path)
    held = lock(time.time(), host="evil" + ESCAPES)
    served.store.put(LOCK, held)
    out = CliRunner().invoke(cli, ["adapt", "rollback"], env={"DFLASH_STORAGE_URL": f"file://{tmp_path}",
                                                              "DFLASH_ADAPT_NAME": "d", "DFLASH_LOG_JSON": "false"})
    assert out.exit_code == 1 and "in progress" in out.output and "evil" in out.output
    assert not any(c in out.output for c in "\x1b\x07\u202e\x9b"), repr(out.output)
    assert served.store.get(LOCK) == held  # the lock stays its holder's


@pytest.mark.parametrize("since", ["1" + "0" * 400, '"soon"', "null", "[1]"])
def test_a_lock_or_mark_dated_beyond_any_float_is_no_live_holder_s(tmp_path, since):
    served = served_with(tmp_path)
    raw = f'{{"action": "promotion", "host": "h", "pid": 1, "since": {since}}}'.encode()
    served.store.put(LOCK, raw)
    served.store.put(mark_of(raw), f'{{"since": {since}}}'.encode())
    assert served.record({"action": "refused"})["action"] == "refused"
    assert not served.store.exists(LOCK) and not list(served.store.list(LOCKS))
