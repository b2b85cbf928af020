"""The fault campaign's invariant checks and plans (benchmarks/faults_checks.py, faults_plan.py) on
synthetic records: each violation is found, and clean records pass."""

from __future__ import annotations

import random

import pytest

from benchmarks.faults_checks import RequestRecord, Settle, check_pd_kv, check_request, check_settle, summarize
from benchmarks.faults_client import Call, Outcome
from benchmarks.faults_plan import Fault, Prompt, RequestPlan, draw_plans, prompt_pool

REF = "the colocated answer"
DEADLINE = 60.0


def record(fault: Fault, call: Call, index: int = 0) -> RequestRecord:
    return RequestRecord(RequestPlan(index, Prompt(33, 1, 8), True, fault, 1.0, 2, 0), call)


def test_a_correct_answer_and_an_explicit_error_pass() -> None:
    assert check_request(record(Fault.NONE, Call(Outcome.OK, 200, text=REF, seconds=1.0)), REF, DEADLINE) == []
    error = Call(Outcome.ERROR, 503, detail="HTTP 503: no prefill instance", seconds=2.0)
    assert check_request(record(Fault.KILL_P, error), REF, DEADLINE) == []


def test_wrong_text_is_a_violation() -> None:
    bad = check_request(record(Fault.ZMQ_DUPLICATE, Call(Outcome.OK, 200, text="another answer")), REF, DEADLINE)
    assert len(bad) == 1 and bad[0].startswith("wrong text") and "another answer" in bad[0]


def test_empty_200_is_a_violation() -> None:
    bad = check_request(record(Fault.NONE, Call(Outcome.OK, 200, text="")), REF, DEADLINE)
    assert bad == ["empty answer with HTTP 200"]


def test_hang_and_overrun_are_violations() -> None:
    hang = check_request(record(Fault.STOP_D, Call(Outcome.HANG, detail="ReadTimeout after 60.0 s")), REF, DEADLINE)
    assert hang == ["hang: ReadTimeout after 60.0 s"]
    late = check_request(record(Fault.NONE, Call(Outcome.ERROR, 504, detail="x", seconds=75.0)), REF, DEADLINE)
    assert len(late) == 1 and "past its 60 s deadline" in late[0]


def test_unclear_answer_is_a_violation() -> None:
    cut = Call(Outcome.UNCLEAR, 200, detail="stream ended after 3 events without [DONE] or an error event")
    bad = check_request(record(Fault.KILL_D, cut), REF, DEADLINE)
    assert len(bad) == 1 and "unclear answer (HTTP 200)" in bad[0] and "without [DONE]" in bad[0]


def test_an_abort_only_where_planned() -> None:
    aborted = Call(Outcome.ABORTED, detail="closed after 2 events")
    assert check_request(record(Fault.ABORT_MID_STREAM, aborted), REF, DEADLINE) == []
    bad = check_request(record(Fault.NONE, aborted), REF, DEADLINE)
    assert len(bad) == 1 and "without an abort planned" in bad[0]


def test_recompute_without_a_reason_is_a_violation() -> None:
    assert check_pd_kv({"recomputed_tokens": 0}) == []
    assert check_pd_kv({"recomputed_tokens": 12, "recompute_reason": "kv_load_failed"}) == []
    bad = check_pd_kv([{"recomputed_tokens": 12, "recompute_reason": "x"}, {"recomputed_tokens": 3}])
    assert len(bad) == 1 and "3 token(s) recomputed without a recompute_reason" in bad[0]
    assert len(check_pd_kv({"recomputed_tokens": 2, "recompute_reason": "none"})) == 1  # "none" is no reason
    unlabelled = Call(Outcome.OK, 200, text=REF, pd_kv={"recomputed_tokens": 5, "recompute_reason": ""})
    assert len(check_request(record(Fault.NONE, unlabelled), REF, DEADLINE)) == 1


def test_settle_within_the_room_lease_plus_one_second() -> None:
    ok = [Settle("prefill0", 0.4, (0.0, 0.0)), Settle("decode0", 6.9, (0.0, 0.0))]
    assert check_settle(ok, 7.0) == []
    bad = check_settle([Settle("prefill1", None, (0.0312, 2.0)), Settle("decode1", 7.5, (0.0, 0.0))], 7.0)
    assert len(bad) == 2
    assert bad[0].startswith("prefill1: KV usage 0.0312 and rooms held 2 not back") and bad[1].startswith("decode1")


def test_summary_counts_per_class_and_says_when_recompute_labels_were_skipped() -> None:
    recomputed = {"pushed_tokens": 30, "recomputed_tokens": 3, "recompute_reason": "load_failed"}
    records = [
        record(Fault.NONE, Call(Outcome.OK, 200, text=REF, pd_kv=recomputed), 0),
        record(Fault.NONE, Call(Outcome.OK, 200, text="wrong"), 1),
        record(Fault.KILL_P, Call(Outcome.ERROR, 502, detail="HTTP 502: prefill_failed"), 2),
    ]
    for r in records:
        check_request(r, REF, DEADLINE)
    summary = summarize(records, pd_kv_seen=False)
    none = summary["classes"]["none"]  # type: ignore[index]
    assert (none["requests"], none["ok"], none["explicit_errors"]) == (2, 2, 0)
    assert none["violations"][0]["request"] == 1
    assert none["recomputes"] == {"load_failed": 1}
    assert summary["classes"]["kill_p"]["explicit_errors"] == 1  # type: ignore[index]
    assert summary["totals"] == {"requests": 3, "ok": 2, "explicit_errors": 1, "aborted": 0, "violations": 1}
    assert summary["recompute_labels"].startswith("skipped")  # type: ignore[union-attr]
    assert summarize(records, pd_kv_seen=True)["recompute_labels"] == "checked"


def test_plans_replay_from_the_seed_and_cover_every_class() -> None:
    def draw(seed: int) -> list[RequestPlan]:
        rng = random.Random(seed)
        return draw_plans(rng, prompt_pool(rng), 110, every_class=True)

    first, again = draw(5), draw(5)
    assert first == again and first != draw(6)
    assert {p.fault for p in first} == set(Fault)
    assert all(p.stream for p in first if p.fault.needs_stream)
    assert not any(p.stream for p in first if p.fault is Fault.ABORT_DURING_DRAIN)
    assert first[0].fault is Fault.NONE and first[1].fault is Fault.NONE  # the quiet start
    with pytest.raises(ValueError, match="too few for every fault class"):
        draw_plans(random.Random(1), prompt_pool(random.Random(1)), 10, every_class=True)


def test_kills_are_capped_in_long_runs() -> None:
    rng = random.Random(3)
    plans = draw_plans(rng, prompt_pool(rng), 1000, every_class=True)
    kills = sum(p.fault in (Fault.KILL_P, Fault.KILL_D) for p in plans)
    assert 2 <= kills <= 1000 // 40 + 2
