"""Rooms are unique on P, n > 1 decodes load one prefill, cancels free at once.

Scheduler side with the fakes of test_scheduler; transfer side on the in-process backend rig of
test_transfer_manager (real ZMQ, real bootstrap server)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from pd_connector import messages as proto
from pd_connector.kv_params import prefill_refused
from pd_connector.metadata import SendJob
from pd_connector.scheduler import PDScheduler
from pd_connector.transfer.states import RoomState
from tests.support.fake_scheduler import FakeRequest, meta
from tests.support.loopback import wait_for
from tests.support.transfer_rig import BLOCK_SIZE, Rig, assert_landed, recv_job, snapshot

DONE = RequestStatus.FINISHED_LENGTH_CAPPED


def _finish(s: PDScheduler, rid: str, room: int, samples: int | None = None) -> tuple[bool, dict | None]:
    params = {"do_remote_decode": True, "bootstrap_room": room}
    if samples is not None:
        params["decode_samples"] = samples
    return s.request_finished(FakeRequest(rid, params, 40, DONE), [1, 2, 3])


def test_scheduler_refuses_a_second_request_with_a_live_room(psched: PDScheduler) -> None:  # noqa: F811
    assert _finish(psched, "a", 5)[0] is True
    held, answer = _finish(psched, "b", 5)
    assert held is False  # vLLM frees b's blocks at once
    assert answer == prefill_refused(5, "bootstrap_room 5 is in use by request a")
    assert [s.req_id for s in meta(psched).sends] == ["a"]
    psched.update_connector_output(KVConnectorOutput(finished_sending={"a"}))
    assert _finish(psched, "c", 5)[0] is True  # the room is free again once a's KV went


def test_scheduler_sends_the_sample_count(psched: PDScheduler) -> None:  # noqa: F811
    assert _finish(psched, "a", 6, samples=3)[0] is True
    assert meta(psched).sends[0].samples == 3


def test_n_decode_requests_of_one_room_each_get_the_kv_then_p_frees_once(rig: Rig) -> None:
    p = rig.make("prefill", seed=3)
    d = rig.make("decode")
    before = snapshot(d.kv)
    src = [1, 2, 3]
    p.mgr.add_sends([SendJob("p-req", 31, src, 3 * BLOCK_SIZE, samples=3)])
    d.mgr.add_recvs([recv_job(rig, "0_d", 31, [4, 5, 6]), recv_job(rig, "1_d", 31, [7, 8, 9])])
    d.wait_recv("0_d")
    d.wait_recv("1_d")
    assert p.room_state(31) is RoomState.READY and "p-req" not in p.sending  # a third sample is expected
    d.mgr.add_recvs([recv_job(rig, "2_d", 31, [10, 11, 12])])
    d.wait_recv("2_d")
    p.wait_sent("p-req")
    assert d.failed == {}
    assert_landed(p, d, before, src * 3, [4, 5, 6, 7, 8, 9, 10, 11, 12])
    assert p.idle() and d.idle() and p.stats().transfers_ok == 3


def test_a_cancelled_sample_counts_as_served(rig: Rig) -> None:
    p = rig.make("prefill", seed=4)
    d = rig.make("decode")
    p.mgr.add_sends([SendJob("p-req", 32, [1], BLOCK_SIZE, samples=2)])
    d.mgr.add_recvs([recv_job(rig, "0_d", 32, [4])])
    d.wait_recv("0_d")
    d.mgr.channel.send(p.mgr.endpoint, proto.TransferCancel(room=32, request_id="1_d"))
    p.wait_sent("p-req", timeout=2)
    assert p.idle()


def test_second_prefill_of_a_live_room_is_refused_and_freed_never_overwrites(rig: Rig) -> None:
    p = rig.make("prefill", seed=5)
    d = rig.make("decode")
    before = snapshot(d.kv)
    p.mgr.add_sends([SendJob("p-1", 33, [1, 2], 2 * BLOCK_SIZE)])
    p.mgr.add_sends([SendJob("p-2", 33, [7, 8], 2 * BLOCK_SIZE)])
    p.wait_sent("p-2", timeout=2)  # refused: its blocks go back at once
    assert p.stats().rooms_refused == 1 and p.room_state(33) is RoomState.READY
    d.mgr.add_recvs([recv_job(rig, "d", 33, [4, 5])])
    d.wait_recv("d")
    p.wait_sent("p-1")
    assert_landed(p, d, before, [1, 2], [4, 5])  # the first prefill's KV, not the second's
    assert p.idle() and d.idle()


@pytest.mark.parametrize("first", ["prefill", "cancel"])
def test_cancel_before_decode_asked_frees_the_room_at_once(rig: Rig, first: str) -> None:
    p = rig.make("prefill", seed=6)
    rig.make("decode")
    job = SendJob("p-req", 34, [1], BLOCK_SIZE)
    cancel = proto.TransferCancel(room=34, request_id="d-req")
    if first == "prefill":
        p.mgr.add_sends([job])
        p.mgr.prefill.on_cancel(cancel)  # type: ignore[union-attr]
    else:
        p.mgr.prefill.on_cancel(cancel)  # type: ignore[union-attr]
        assert p.idle()  # nothing lingers: the cancel is remembered, no room is held
        p.mgr.add_sends([job])
    p.wait_sent("p-req", timeout=1)
    assert p.idle()
    wait_for(lambda: p.idle(), 1)


def test_decode_abort_while_waiting_for_prefill_cancels_on_p(rig: Rig) -> None:
    """vLLM aborted a D request whose KV P has not produced yet: P drops the request and answers, D
    releases the load as failed within a second (not after kv_wait_timeout_s), nothing lingers."""
    p = rig.make("prefill", seed=7)
    d = rig.make("decode")
    d.mgr.add_recvs([recv_job(rig, "d-req", 35, [4, 5])])
    wait_for(lambda: p.room_state(35) is RoomState.AWAITING_PREFILL, what="P to hold D's request")
    t0 = time.monotonic()
    d.mgr.decode.cancel({"d-req", "some-finished-request"})  # type: ignore[union-attr]
    d.wait_recv("d-req", timeout=1.5)
    assert time.monotonic() - t0 < 1.5 and d.failed == {"d-req": [4, 5]}
    wait_for(p.idle, 1, what="P to drop the cancelled request")
    p.mgr.add_sends([SendJob("p-req", 35, [1, 2], 2 * BLOCK_SIZE)])  # its prefill ends later: freed at once
    p.wait_sent("p-req", timeout=1)
    assert p.idle() and d.idle()


def test_decode_abort_before_asking_frees_p_room_at_once(rig: Rig) -> None:
    p = rig.make("prefill", seed=8)
    d = rig.make("decode")
    before = snapshot(d.kv)
    p.mgr.add_sends([SendJob("p-req", 36, [1, 2], 2 * BLOCK_SIZE)])
    d.mgr.decode.cancel({"d-req"})  # type: ignore[union-attr]  # no load yet: nothing to cancel
    d.mgr.add_recvs([recv_job(rig, "d-req", 36, [4, 5])])
    d.mgr.decode.cancel({"d-req"})  # type: ignore[union-attr]
    d.wait_recv("d-req", timeout=2)
    p.wait_sent("p-req", timeout=2)
    assert d.failed == {"d-req": [4, 5]} and p.idle() and d.idle()
    if p.stats().transfers_ok == 0:  # cancelled before P wrote: D's blocks untouched
        assert all(torch.equal(d.kv[k], before[k]) for k in d.kv)


def test_a_cancel_racing_the_request_reaches_p_after_it(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM aborts a load while D's handshake thread is sending its TransferRequest: the cancel must not
    overtake the request (P would close the room as cancelled, then hold the late request for its
    closed-room grace before refusing it, and D's blocks with it)."""
    p = rig.make("prefill", seed=9)
    d = rig.make("decode")
    p.mgr.add_sends([SendJob("p-req", 37, [1, 2], 2 * BLOCK_SIZE)])
    ctx = d.mgr.decode._ctx  # type: ignore[union-attr]
    real_send = ctx.send
    racer: list[threading.Thread] = []

    def send(endpoint: str, msg: proto.Message) -> None:
        if isinstance(msg, proto.TransferRequest) and not racer:  # the abort lands mid-send
            racer.append(threading.Thread(target=d.mgr.decode.cancel, args=({"d-req"},)))  # type: ignore[union-attr]
            racer[0].start()
            time.sleep(0.3)
        real_send(endpoint, msg)

    monkeypatch.setattr(d.mgr.decode, "_ctx", dataclasses.replace(ctx, send=send))
    d.mgr.add_recvs([recv_job(rig, "d-req", 37, [4, 5])])
    wait_for(lambda: racer, 2, what="the request being sent")
    racer[0].join(timeout=2)
    d.wait_recv("d-req", timeout=2)  # P answered the cancel at once, not after its closed-room grace
    p.wait_sent("p-req", timeout=2)
    assert d.failed == {"d-req": [4, 5]} and p.idle() and d.idle()
