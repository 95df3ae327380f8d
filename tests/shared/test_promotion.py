"""The served drafter's store and the promotion rule: refused within the noise, promoted beyond it, rollback
restoring the previous drafter byte for byte, on a local disk and on S3 (moto's server)."""

from __future__ import annotations

import hashlib
import json
import math
import os

import pytest
from dfp_adapt.rule import decide, paired
from dfp_adapt.served_store import PromotionError, ServedDrafters, check_name
from dfp_shared.storage.store import open_store


def write_export(store_uri: str, seed: int, endpoint_url: str | None = None, extra: bool = False) -> dict[str, bytes]:
    """A drafter export's files (a config and random weights' bytes), written under ``store_uri``."""
    files = {"config.json": json.dumps({"architectures": ["DFlashDraftModel"], "seed": seed}).encode(),
             "model.safetensors": os.urandom(200_000 + seed),
             "modeling_dflash.py": f"# modeling file {seed}\n".encode()}
    if extra:
        files["draft_vocab.json"] = b'{"size": 512}'
    store = open_store(store_uri, endpoint_url=endpoint_url)
    for name, data in files.items():
        store.put(name, data)
    return files


def current_files(served: ServedDrafters) -> dict[str, bytes]:
    """The files of the drafter serving reads: the version the pointer names."""
    now = served.current()
    if now is None:
        return {}
    prefix = f"versions/{now.version}/"
    return {k[len(prefix):]: served.store.get(k) for k in served.store.list(prefix)}


# --- the rule ----------------------------------------------------------------------------------------------

SERVED = [1.80, 2.10, 1.95, 2.40, 1.70, 2.05, 2.20, 1.90]


def test_a_candidate_within_the_noise_is_refused():
    # better on average by 0.1, but the per-prompt differences swing by +-0.6: not beyond the noise
    swings = [0.7, -0.5, 0.6, -0.4, 0.7, -0.5, 0.6, -0.4]
    candidate = [s + d for s, d in zip(SERVED, swings)]
    d = decide(candidate, SERVED, threshold=0.05)
    assert not d.promote
    assert d.mean_difference == pytest.approx(0.1)
    assert d.mean_difference > d.threshold
    assert d.mean_difference < d.t_quantile * d.standard_error
    assert "within the noise" in d.reason


def test_a_candidate_below_the_threshold_is_refused_however_steady():
    candidate = [s + 0.03 for s in SERVED]  # steady gain, no spread at all, but under the operator's margin
    d = decide(candidate, SERVED, threshold=0.05)
    assert not d.promote and d.standard_error == pytest.approx(0.0, abs=1e-12)
    assert "not above the threshold" in d.reason


def test_a_worse_candidate_is_refused():
    assert not decide([s - 0.3 for s in SERVED], SERVED, threshold=0.0).promote


def test_a_candidate_better_beyond_the_noise_is_promoted():
    gains = [0.30, 0.42, 0.25, 0.38, 0.33, 0.29, 0.41, 0.35]
    d = decide([s + g for s, g in zip(SERVED, gains)], SERVED, threshold=0.05)
    assert d.promote
    mean = sum(gains) / len(gains)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gains) / (len(gains) - 1))
    assert d.mean_difference == pytest.approx(mean)
    assert d.standard_error == pytest.approx(sd / math.sqrt(len(gains)))
    assert d.mean_candidate - d.mean_baseline == pytest.approx(mean)


def test_too_few_prompts_decide_nothing():
    assert not decide([3.0], [1.0], threshold=0.0, min_prompts=2).promote
    assert not decide([], [], threshold=0.0).promote
    # seven steady gains are fewer than the operator's eight: refused, however clear
    d = decide([s + 0.5 for s in SERVED[:7]], SERVED[:7], threshold=0.0)
    assert not d.promote and "at least 8" in d.reason
    assert decide([s + 0.5 for s in SERVED[:7]], SERVED[:7], threshold=0.0, min_prompts=7).promote


def test_prompts_are_paired_by_id():
    cand, base = paired({"a": 2.0, "b": 3.0, "c": 1.0}, {"c": 1.5, "a": 1.0, "z": 9.0})
    assert cand == [2.0, 1.0] and base == [1.0, 1.5]
    cand, base = paired({"a": 2.0, "b": float("nan"), "c": 1.0}, {"a": 1.0, "b": 1.0, "c": float("inf")})
    assert cand == [2.0] and base == [1.0]  # a prompt without a finite τ on either side is left out


@pytest.mark.parametrize(("threshold", "alpha", "min_prompts"), [
    (-0.1, 0.025, 8), (float("inf"), 0.025, 8), (float("nan"), 0.025, 8), (0.1, 0.6, 8), (0.1, 0.0, 8),
    (0.1, float("nan"), 8), (0.1, 0.025, 1), (0.1, 0.025, 10_001), (0.1, 0.025, 8.0)])
def test_the_rule_numbers_are_bounded(threshold, alpha, min_prompts):
    with pytest.raises(ValueError):
        decide([1.0, 2.0], [1.0, 1.0], threshold=threshold, alpha=alpha, min_prompts=min_prompts)


def test_the_quantile_is_student_s_t_at_n_minus_one_degrees_of_freedom():
    d = decide([s + g for s, g in zip(SERVED, [0.3, 0.4] * 4)], SERVED, threshold=0.0)
    assert d.t_quantile == pytest.approx(2.3646, abs=1e-4)  # t(0.975, 7)


# --- the store ---------------------------------------------------------------------------------------------

@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path):
    """(root URI, endpoint) on a local disk and on moto's S3 server."""
    if request.param == "local":
        return f"file://{tmp_path}", None
    s3 = request.getfixturevalue("s3_server")
    return request.getfixturevalue("s3_bucket") + "/data", s3.endpoint_url


def test_promote_then_rollback_restores_the_previous_drafter_byte_for_byte(place):
    root, endpoint = place
    first = write_export(f"{root}/runs/1/drafter", 1, endpoint)
    second = write_export(f"{root}/runs/2/drafter", 2, endpoint, extra=True)  # adds a file the first lacks
    served = ServedDrafters(f"{root}/served", "qwen3-8b", endpoint)
    assert served.current_version() is None

    e1 = served.promote(f"{root}/runs/1/drafter/", {"source_job": "job1"})
    assert e1["version"] == 1 and current_files(served) == first
    e2 = served.promote(f"{root}/runs/2/drafter/", {"source_job": "job2"})
    assert e2["version"] == 2 and current_files(served) == second
    assert served.current_version() == 2

    event = served.rollback("regressed in production")
    assert event == {**event, "action": "rolled_back", "version": 1, "undone": 2}
    restored = current_files(served)
    assert restored == first  # the same files, every byte; the second's extra file is not served
    assert {k: hashlib.sha256(v).hexdigest() for k, v in restored.items()} == \
           {k: hashlib.sha256(v).hexdigest() for k, v in first.items()}
    assert served.current_version() == 1
    # the versions stay as they were promoted
    assert {k[len("versions/2/"):]: served.store.get(k) for k in served.store.list("versions/2/")} == second
    actions = [e["action"] for e in served.history()["events"]]
    assert actions == ["promoted", "promoted", "rolled_back"]

    with pytest.raises(PromotionError, match="no earlier version"):
        served.rollback()
    e3 = served.promote(f"{root}/runs/2/drafter/", {"source_job": "job3"})
    assert e3["version"] == 3 and served.history()["stack"] == [1, 3]


def test_a_refusal_is_recorded_and_changes_nothing_served(tmp_path):
    write_export(f"file://{tmp_path}/runs/1/drafter", 1)
    served = ServedDrafters(f"file://{tmp_path}/served", "d", None)
    served.promote(f"file://{tmp_path}/runs/1/drafter/", {})
    before = current_files(served)
    served.record({"action": "refused", "reason": "mean τ gain 0.1 is within the noise"})
    assert current_files(served) == before
    history = served.history()
    assert history["stack"] == [1] and history["events"][-1]["action"] == "refused"


def test_a_candidate_that_is_no_export_is_refused(tmp_path):
    open_store(f"file://{tmp_path}/runs/x").put("weights.bin", b"x")
    served = ServedDrafters(f"file://{tmp_path}/served", "d", None)
    with pytest.raises(PromotionError, match="no config.json"):
        served.promote(f"file://{tmp_path}/runs/x/", {})
    assert served.current_version() is None


@pytest.mark.parametrize("name", ["", "../up", "a/b", ".hidden", "x" * 65])
def test_drafter_names_are_checked(name):
    with pytest.raises(PromotionError):
        check_name(name)


def test_a_history_that_is_not_one_is_refused(tmp_path):
    served = ServedDrafters(f"file://{tmp_path}/served", "d", None)
    served.store.put("history.json", b'{"stack": ["../x"], "events": []}')
    with pytest.raises(PromotionError, match="not a served drafter's history"):
        served.current_version()


@pytest.mark.parametrize("body, reason", [(b'{"stack": [true], "events": []}', "not a served drafter's history"),
                                          (b"[" * 100_000 + b"]" * 100_000, "nested too deeply|not JSON")])
def test_a_hostile_history_is_refused_with_its_reason(tmp_path, body, reason):
    served = ServedDrafters(f"file://{tmp_path}/served", "d", None)
    served.store.put("history.json", body)
    with pytest.raises(PromotionError, match=reason):
        served.current_version()


def test_a_long_history_drops_its_oldest_events_and_stays_readable(tmp_path, monkeypatch):
    from dfp_adapt import served_store as promotion

    monkeypatch.setattr(promotion, "MAX_HISTORY_BYTES", 64 << 10)
    served = ServedDrafters(f"file://{tmp_path}/served", "d", None)
    for i in range(400):
        served.record({"action": "refused", "reason": f"run {i}: " + "x" * 300})
    history = served.history()  # read under the same bound it was written by
    assert len(served.store.get("history.json")) <= 32 << 10
    assert history["events"][-1]["reason"].startswith("run 399:") and len(history["events"]) < 400


# --- one change at a time -------------------------------------------------------------------------------------

def test_a_rollback_while_a_promotion_copies_is_refused_and_nothing_is_lost(tmp_path, monkeypatch):
    """A scheduled run's promotion and an operator's rollback at once: the second waits its turn (refused, naming
    the change in progress), instead of both moving the served pointer and rewriting the history from what each read first."""
    import dfp_adapt.served_store as promotion

    served = ServedDrafters(f"file://{tmp_path}/served", "d")
    for seed in (1, 2):
        write_export(f"file://{tmp_path}/c{seed}", seed)
        served.promote(f"file://{tmp_path}/c{seed}", {"run": seed})
    write_export(f"file://{tmp_path}/c3", 3)
    operator = ServedDrafters(f"file://{tmp_path}/served", "d")
    seen = {}
    copy = promotion._copy

    def copy_then_rollback(*args):
        copy(*args)
        if "refused" not in seen:  # midway through the promotion's copies, the operator rolls back
            with pytest.raises(PromotionError, match=r"a promotion .* is in progress") as err:
                operator.rollback("bad drafter")
            seen["refused"] = str(err.value)
            with pytest.raises(PromotionError, match="in progress"):
                operator.record({"action": "refused"})

    monkeypatch.setattr(promotion, "_copy", copy_then_rollback)
    served.promote(f"file://{tmp_path}/c3", {"run": 3})
    assert served.history()["stack"] == [1, 2, 3]
    assert operator.rollback("bad drafter")["version"] == 2  # its turn once the promotion ended
    assert [e["action"] for e in served.history()["events"]] == ["promoted", "promoted", "promoted", "rolled_back"]


def test_a_change_that_died_midway_holds_the_store_only_until_its_lock_expires(tmp_path, monkeypatch):
    import dfp_adapt.served_store as promotion

    served = ServedDrafters(f"file://{tmp_path}/served", "d")
    write_export(f"file://{tmp_path}/c1", 1)
    served.store.put("lock.json", json.dumps({"action": "promotion", "host": "gone", "pid": 1,
                                              "since": 1_000.0}).encode())
    monkeypatch.setattr(promotion.time, "time", lambda: 1_000.0 + promotion.LOCK_TTL_S - 1)
    with pytest.raises(PromotionError, match="in progress"):
        served.promote(f"file://{tmp_path}/c1", {})
    monkeypatch.setattr(promotion.time, "time", lambda: 1_000.0 + promotion.LOCK_TTL_S + 1)
    assert served.promote(f"file://{tmp_path}/c1", {})["version"] == 1
    assert not served.store.exists("lock.json")  # released after
    served.store.put("lock.json", b"\x00 not json")  # unreadable: as old as can be
    assert served.record({"action": "refused"})["action"] == "refused"


@pytest.mark.parametrize("since", ["1e18", "Infinity", "4102444800.0"])
def test_a_lock_dated_impossibly_is_taken_over_at_once(tmp_path, since):
    import dfp_adapt.served_store as promotion

    served = ServedDrafters(f"file://{tmp_path}/served", "d")
    served.store.put(promotion.LOCK, f'{{"action": "promotion", "host": "h", "pid": 1, "since": {since}}}'.encode())
    assert served.record({"action": "refused"})["action"] == "refused"
    assert not served.store.exists(promotion.LOCK) and not list(served.store.list(promotion.LOCKS))


def test_of_two_that_find_one_stale_lock_only_one_takes_it_and_a_late_holder_leaves_the_new_lock(tmp_path):
    import dfp_adapt.served_store as promotion

    a, b, c = (ServedDrafters(f"file://{tmp_path}/served", "d") for _ in range(3))
    stale = json.dumps({"action": "promotion", "host": "gone", "pid": 1, "since": 0.0}).encode()
    a.store.put(promotion.LOCK, stale)
    with a._changing("rollback"):  # a takes the stale lock over...
        with pytest.raises(PromotionError, match="in progress"):  # ...b, finding a's live lock, is refused
            b.record({"action": "refused"})
        # c read the same stale lock before a replaced it: its takeover mark exists, so it is refused too
        mark = f"{promotion.LOCKS}takeover-{hashlib.sha256(stale).hexdigest()[:32]}.json"
        assert not c.store.put_if_absent(mark, b"c")
        held = json.loads(a.store.get(promotion.LOCK))
        # a change that ran past the TTL and was taken over (here: its token replaced) does not delete the new lock
        a.store.put(promotion.LOCK, json.dumps({**held, "token": "the taker's"}).encode())
    assert json.loads(a.store.get(promotion.LOCK))["token"] == "the taker's"
