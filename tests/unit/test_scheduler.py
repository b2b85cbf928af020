"""PDScheduler with tiny fakes for vLLM's Request and KVCacheBlocks."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from pd_connector.metadata import RecvJob, SendJob
from pd_connector.scheduler import PDScheduler
from tests.support.fake_scheduler import D_PARAMS, P_PARAMS, FakeBlocks, FakeRequest, meta

# ------------------------------------------------------------------ decode side


def test_decode_asks_for_the_uncomputed_prompt(dsched: PDScheduler) -> None:
    assert dsched.get_num_new_matched_tokens(FakeRequest("a", dict(D_PARAMS), 100), 0) == (100, True)
    assert dsched.get_num_new_matched_tokens(FakeRequest("b", dict(D_PARAMS), 100), 32) == (68, True)


@pytest.mark.parametrize(
    "params",
    [None, {}, {"do_remote_prefill": False, "bootstrap_room": 1}, dict(P_PARAMS)],
)
def test_decode_without_remote_prefill_is_local(dsched: PDScheduler, params: Any) -> None:
    req = FakeRequest("r", params, 100)
    assert dsched.get_num_new_matched_tokens(req, 0) == (0, False)
    dsched.update_state_after_alloc(req, FakeBlocks(list(range(7))), 0)
    assert meta(dsched).recvs == []


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({**D_PARAMS, "bootstrap_port": 0}, "bootstrap_port"),
        ({**D_PARAMS, "bootstrap_room": -1}, "bootstrap_room"),
        ({**D_PARAMS, "bootstrap_host": ""}, "bootstrap_host"),
        ({**D_PARAMS, "do_remote_decode": True}, "do_remote_decode"),
        ("not-a-dict", "JSON object"),
    ],
)
def test_decode_malformed_params_are_logged_and_served_locally(
    dsched: PDScheduler, pd_logs: pytest.LogCaptureFixture, params: Any, field: str
) -> None:
    req = FakeRequest("bad", params, 100)
    assert dsched.get_num_new_matched_tokens(req, 0) == (0, False)
    errors = [r for r in pd_logs.records if r.levelname == "ERROR"]
    assert len(errors) == 1
    assert "req=bad" in errors[0].getMessage() and field in errors[0].getMessage()
    dsched.update_state_after_alloc(req, FakeBlocks(list(range(7))), 0)
    assert meta(dsched).recvs == []
    assert dsched.request_finished(req, [0]) == (False, None)


def test_decode_recv_job_after_alloc(dsched: PDScheduler) -> None:
    req = FakeRequest("req-1", dict(D_PARAMS), 100)  # 7 blocks, the last one partial
    assert dsched.get_num_new_matched_tokens(req, 32) == (68, True)
    blocks = FakeBlocks([40, 41, 10, 11, 12, 30, 31, 99])  # one extra block beyond the prompt
    dsched.update_state_after_alloc(req, blocks, 68)
    # Called again (the request stays waiting for remote KV): no second plan.
    assert dsched.get_num_new_matched_tokens(req, 32) == (0, False)
    dsched.update_state_after_alloc(req, blocks, 68)
    m = meta(dsched)
    assert m.recvs == [
        RecvJob(
            req_id="req-1",
            room=77,
            bootstrap_host="10.1.2.3",
            bootstrap_port=18800,
            prefill_dp_rank=1,
            dst_block_ids=[10, 11, 12, 30, 31],
            start_block=2,
            num_tokens=100,
        )
    ]
    assert m.recvs[0].bootstrap_addr == "10.1.2.3:18800"
    assert m.sends == [] and m.dropped_rooms == []
    # build_connector_meta drains.
    assert meta(dsched).recvs == []


def test_decode_no_local_hit_and_no_dp_rank(dsched: PDScheduler) -> None:
    params = {k: v for k, v in D_PARAMS.items() if k != "prefill_dp_rank"}
    req = FakeRequest("req-2", params, 32)
    assert dsched.get_num_new_matched_tokens(req, 0) == (32, True)
    dsched.update_state_after_alloc(req, FakeBlocks([5, 6]), 32)
    (job,) = meta(dsched).recvs
    assert job.dst_block_ids == [5, 6] and job.start_block == 0 and job.prefill_dp_rank is None


def test_decode_full_local_hit_still_frees_the_room(dsched: PDScheduler) -> None:
    req = FakeRequest("req-3", dict(D_PARAMS), 64)
    assert dsched.get_num_new_matched_tokens(req, 64) == (0, False)
    dsched.update_state_after_alloc(req, FakeBlocks([1, 2, 3, 4]), 0)
    m = meta(dsched)
    assert m.recvs == []  # no load: vLLM schedules the request at once and must not hear of one
    (job,) = m.abandoned
    assert job.dst_block_ids == [] and job.room == 77


def test_decode_continuation_loads_only_what_p_prefilled(dsched: PDScheduler) -> None:
    """The Router's first-token path: D's prompt is P's 64 tokens plus P's first token."""
    req = FakeRequest("req-c", {**D_PARAMS, "prefilled_tokens": 64}, 65)
    assert dsched.get_num_new_matched_tokens(req, 16) == (48, True)  # D computes token 65 itself
    dsched.update_state_after_alloc(req, FakeBlocks([1, 2, 3, 4, 5]), 48)
    (job,) = meta(dsched).recvs
    assert job.num_tokens == 64 and job.start_block == 1 and job.dst_block_ids == [2, 3, 4]


def test_decode_continuation_fully_cached_frees_the_room(dsched: PDScheduler) -> None:
    req = FakeRequest("req-c2", {**D_PARAMS, "prefilled_tokens": 64}, 65)
    assert dsched.get_num_new_matched_tokens(req, 64) == (0, False)
    dsched.update_state_after_alloc(req, FakeBlocks([1, 2, 3, 4, 5]), 0)
    m = meta(dsched)
    assert m.recvs == []
    (job,) = m.abandoned
    assert job.dst_block_ids == [] and job.room == 77


def test_decode_prefilled_tokens_never_exceed_the_prompt(dsched: PDScheduler) -> None:
    req = FakeRequest("req-c3", {**D_PARAMS, "prefilled_tokens": 500}, 40)
    assert dsched.get_num_new_matched_tokens(req, 0) == (40, True)


def test_decode_request_finished_forgets_the_request(dsched: PDScheduler) -> None:
    req = FakeRequest("req-4", dict(D_PARAMS), 40)
    dsched.get_num_new_matched_tokens(req, 0)
    dsched.update_state_after_alloc(req, FakeBlocks([0, 1, 2]), 40)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, answer = dsched.request_finished(req, [0, 1, 2])
    assert not delay and answer is not None and set(answer) == {"pd_kv"}  # its KV account (test_accounting)
    assert not dsched._recv_planned and not dsched._parsed and not dsched._local_hits
    assert not dsched.has_pending_push_work()


def test_prefill_scheduler_never_loads(psched: PDScheduler) -> None:
    req = FakeRequest("r", dict(D_PARAMS), 100)
    assert psched.get_num_new_matched_tokens(req, 0) == (0, False)
    psched.update_state_after_alloc(req, FakeBlocks(list(range(7))), 0)
    assert meta(psched).recvs == []


# ----------------------------------------------------------------- prefill side


@pytest.mark.parametrize("status", [RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED])
def test_prefill_finished_holds_blocks_until_sent(psched: PDScheduler, status: RequestStatus) -> None:
    req = FakeRequest("p-1", dict(P_PARAMS), 50, status)
    # The answer is what D needs (P-then-D proxies pass it on), room and prefill_done included.
    answer = {
        "bootstrap_room": 88,
        "prefill_done": True,
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 18800,
        "prefill_dp_rank": 0,
    }
    assert psched.request_finished(req, [3, 4, 8, 9]) == (True, answer)
    assert psched.has_pending_push_work()
    m = meta(psched)
    assert m.sends == [SendJob(req_id="p-1", room=88, block_ids=[3, 4, 8, 9], num_tokens=50)]
    assert m.recvs == [] and m.dropped_rooms == []
    assert meta(psched).sends == []
    # Still holding the blocks until the workers report the push.
    assert psched.has_pending_push_work()
    psched.update_connector_output(KVConnectorOutput(finished_sending=None, finished_recving={"p-1"}))
    assert psched.has_pending_push_work()
    psched.update_connector_output(KVConnectorOutput(finished_sending={"other"}))
    assert psched.has_pending_push_work()
    psched.update_connector_output(KVConnectorOutput(finished_sending={"p-1"}))
    assert not psched.has_pending_push_work()


@pytest.mark.parametrize(
    "status",
    [RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_IGNORED],
)
def test_prefill_aborted_drops_the_room(psched: PDScheduler, status: RequestStatus) -> None:
    req = FakeRequest("p-2", dict(P_PARAMS), 50, status)
    assert psched.request_finished(req, [1, 2]) == (False, None)
    assert not psched.has_pending_push_work()
    m = meta(psched)
    assert m.dropped_rooms == [88] and m.sends == []
    assert meta(psched).dropped_rooms == []


def test_prefill_without_blocks_drops_the_room(psched: PDScheduler) -> None:
    req = FakeRequest("p-3", dict(P_PARAMS), 50, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert psched.request_finished(req, []) == (False, None)
    assert meta(psched).dropped_rooms == [88]


@pytest.mark.parametrize("params", [None, {}, dict(D_PARAMS)])
def test_prefill_plain_request_is_freed_normally(psched: PDScheduler, params: Any) -> None:
    req = FakeRequest("p-4", params, 50, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert psched.request_finished(req, [1]) == (False, None)
    m = meta(psched)
    assert m.sends == [] and m.dropped_rooms == [] and not psched.has_pending_push_work()


def test_prefill_malformed_params_logged(psched: PDScheduler, pd_logs: pytest.LogCaptureFixture) -> None:
    req = FakeRequest("p-5", {"do_remote_decode": True, "bootstrap_room": "x"}, 50, RequestStatus.FINISHED_STOPPED)
    assert psched.request_finished(req, [1]) == (False, None)
    assert "bootstrap_room" in pd_logs.text and "p-5" in pd_logs.text
    assert not psched.has_pending_push_work()


def test_prefill_several_requests(psched: PDScheduler) -> None:
    for i in range(3):
        req = FakeRequest(f"p{i}", {"do_remote_decode": True, "bootstrap_room": i}, 16, RequestStatus.FINISHED_STOPPED)
        assert psched.request_finished(req, [i])[0] is True
    assert [s.room for s in meta(psched).sends] == [0, 1, 2]
    psched.update_connector_output(KVConnectorOutput(finished_sending={"p0", "p2"}))
    assert psched.has_pending_push_work()
    psched.update_connector_output(KVConnectorOutput(finished_sending={"p1"}))
    assert not psched.has_pending_push_work()
