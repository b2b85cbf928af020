"""Layer writes per decode peer (transfer/layer_writers.py) and answers that wait for every write.

``PeerWriters`` on its own: a job that blocks on an Event stands for a D that froze (its write hangs
until the transport's timeout). Then the real path (tests/support/transfer_rig.py: a P manager in
layer mode fed save_kv_layer calls, D managers over real ZMQ, the in-process backend): one D frozen,
another D's layers all land while the frozen one's write is still held; and a cancel that comes while
a write is in flight is answered only after that write returned (request mode too). No assertion
is about speed: what is checked is what happened before a held write was let go.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pd_connector import messages as proto
from pd_connector.config import parse_config
from pd_connector.layouts.regions import memory_ranges
from pd_connector.messages import DoneStatus
from pd_connector.metadata import SendJob
from pd_connector.scheduling.layer_chunks import LayerChunk
from pd_connector.transfer.backend import Ints, TransferBackend, Wanted
from pd_connector.transfer.layer_writers import PeerQueueState, PeerWriters
from pd_connector.transfer.registry import create_backend
from pd_connector.transfer.states import RoomState
from tests.support.layer_streams import layer_mode, run_step
from tests.support.loopback import HOST, wait_for
from tests.support.transfer_rig import BLOCK_SIZE, HEADS, Rig, Side, assert_landed, make_kv, recv_job, snapshot

WAIT_S = 10.0

# ------------------------------------------------------------------ PeerWriters alone


def test_a_blocked_peer_holds_only_its_own_thread() -> None:
    writers = PeerWriters(max_workers=4)
    release, frozen_started = threading.Event(), threading.Event()
    live_done = threading.Event()
    ran: list[int] = []
    try:
        writers.submit("frozen", lambda: (frozen_started.set(), release.wait(WAIT_S)))
        assert frozen_started.wait(WAIT_S)
        writers.submit("frozen", lambda: ran.append(-1))  # queued behind the held write: same peer, in order
        for i in range(5):
            writers.submit("live", lambda i=i: ran.append(i))
        writers.submit("live", live_done.set)
        assert live_done.wait(WAIT_S), "the live peer's writes waited behind the frozen peer"
        assert not release.is_set() and ran == [0, 1, 2, 3, 4]  # all done while the frozen write is held
        assert writers.state("frozen") is PeerQueueState.SERVED
    finally:
        release.set()
    wait_for(lambda: ran[-1:] == [-1], what="the frozen peer's queued write after its release")


def test_each_peer_runs_in_order_on_one_thread_at_a_time_and_peers_take_turns() -> None:
    """Two threads, three peers with many jobs each: every peer's jobs in the order queued, never two
    of one peer at once, and a peer waiting for a thread gets one between another peer's jobs."""
    writers = PeerWriters(max_workers=2)
    gate = threading.Event()
    lock = threading.Lock()
    running: dict[str, int] = {}
    overlaps: list[str] = []
    done: dict[str, list[int]] = {"a": [], "b": [], "c": []}

    def job(peer: str, i: int) -> Callable[[], None]:
        def run() -> None:
            gate.wait(WAIT_S)
            with lock:
                running[peer] = running.get(peer, 0) + 1
                if running[peer] > 1:
                    overlaps.append(peer)
            with lock:
                running[peer] -= 1
                done[peer].append(i)

        return run

    for i in range(50):
        for peer in done:
            writers.submit(peer, job(peer, i))
    assert writers.workers <= 2
    gate.set()
    wait_for(lambda: all(len(v) == 50 for v in done.values()), what="every job")
    assert overlaps == []
    assert all(v == list(range(50)) for v in done.values())


def test_the_bound_holds_and_a_waiting_peer_runs_once_a_thread_is_free() -> None:
    writers = PeerWriters(max_workers=2, idle_s=0.05)
    holds = {p: threading.Event() for p in ("x", "y")}
    started = {p: threading.Event() for p in ("x", "y")}
    third = threading.Event()
    try:
        for p in holds:
            writers.submit(p, lambda p=p: (started[p].set(), holds[p].wait(WAIT_S)))
        assert all(e.wait(WAIT_S) for e in started.values())
        writers.submit("z", third.set)
        assert writers.workers == 2 and writers.state("z") is PeerQueueState.WAITING  # both threads held
        holds["x"].set()
        assert third.wait(WAIT_S)
    finally:
        for e in holds.values():
            e.set()
    wait_for(lambda: writers.workers == 0, what="idle writer threads to retire")
    writers.submit("x", third.clear)  # a new thread starts for new work
    wait_for(lambda: not third.is_set(), what="a write after the threads retired")


def test_a_failing_job_keeps_the_thread_and_close_drops_queued_jobs() -> None:
    writers = PeerWriters(max_workers=1)
    hold, after = threading.Event(), threading.Event()
    dropped: list[int] = []

    def broken() -> None:
        raise RuntimeError("boom")

    writers.submit("p", broken)
    writers.submit("p", after.set)
    assert after.wait(WAIT_S)  # the same thread ran on
    started = threading.Event()
    writers.submit("p", lambda: (started.set(), hold.wait(WAIT_S)))
    assert started.wait(WAIT_S)
    writers.submit("p", lambda: dropped.append(1))
    writers.close()
    writers.submit("p", lambda: dropped.append(2))
    hold.set()
    wait_for(lambda: writers.workers == 0, what="the writer to leave after close")
    assert dropped == []


def test_max_workers_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_workers must be >= 1, got 0"):
        PeerWriters(max_workers=0)


# ------------------------------------------------------------------ the real path

Event = tuple[str, Any]


class HeldWrites:
    """P's backend write; a write to ``frozen`` (a D's descriptor) waits for ``release`` (a D that froze,
    its transport hanging), then lands. Logs ("write returned", descriptor) when a held write returned."""

    def __init__(self, inner: Callable[..., None], events: list[Event]) -> None:
        self.inner = inner
        self.events = events
        self.frozen = b""
        self.release = threading.Event()
        self.started = threading.Event()

    def __call__(
        self, peer: bytes, src: Ints, dst: Ints, lengths: Ints, max_batch: int, still_wanted: Wanted = None
    ) -> None:
        if peer != self.frozen:
            self.inner(peer, src, dst, lengths, max_batch, still_wanted)
            return
        try:
            if still_wanted is not None and not still_wanted():
                self.inner(peer, src, dst, lengths, max_batch, still_wanted)  # the backend's own stop (WriteStopped)
            self.started.set()
            assert self.release.wait(30), "a held write was never released"
            self.inner(peer, src, dst, lengths, max_batch)  # in flight already: it lands whatever D said meanwhile
        finally:
            self.events.append(("write returned", peer))


@pytest.fixture
def second_d_backend() -> Iterator[tuple[TransferBackend, dict[str, torch.Tensor]]]:
    """A second D rank's own backend (its own descriptor) and KV; closed after the rig's managers."""
    kv = make_kv()
    backend = create_backend(parse_config("kv_consumer", {"backend": "inproc", "local_ip": HOST}))
    backend.register(memory_ranges(kv))
    try:
        yield backend, kv
    finally:
        backend.close()


def _answers(side: Side, events: list[Event], monkeypatch: pytest.MonkeyPatch) -> None:
    """Log every TransferDone P sends, in order with the held writes' returns."""
    prefill = side.mgr.prefill
    assert prefill is not None
    send = prefill._ctx.send

    def record(endpoint: str, msg: proto.Message) -> None:
        if isinstance(msg, proto.TransferDone):
            events.append(("answer", (msg.request_id, msg.status)))
        send(endpoint, msg)

    monkeypatch.setattr(prefill, "_ctx", dataclasses.replace(prefill._ctx, send=record))


def _cancel_handled(side: Side, events: list[Event], monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once P's listener handled a TransferCancel (any answer it sends at once went out by then)."""
    prefill = side.mgr.prefill
    assert prefill is not None
    handled, on_cancel = threading.Event(), prefill.on_cancel

    def wrapped(cancel: proto.TransferCancel, *args: Any, **kwargs: Any) -> None:
        on_cancel(cancel, *args, **kwargs)
        events.append(("cancel handled", cancel.request_id))
        handled.set()

    monkeypatch.setattr(prefill, "on_cancel", wrapped)
    return handled


def _answered_after_the_write(events: list[Event], req_id: str) -> DoneStatus:
    """The one answer to ``req_id`` came after the held write returned; its status."""
    answers = [i for i, (kind, what) in enumerate(events) if kind == "answer" and what[0] == req_id]
    returned = [i for i, (kind, _) in enumerate(events) if kind == "write returned"]
    assert len(answers) == 1, events
    assert returned and max(returned) < answers[0], f"D was answered while a write was in flight: {events}"
    return events[answers[0]][1][1]


def test_a_frozen_decode_does_not_hold_another_decodes_layers(
    second_d_backend: tuple[TransferBackend, dict[str, torch.Tensor]], rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[Event] = []
    held = HeldWrites(rig.engines.p.write, events)
    monkeypatch.setattr(rig.engines.p, "write", held)
    p, streams = layer_mode(rig, seed=31)
    frozen = rig.make("decode")
    held.frozen = rig.engines.d.descriptor
    backend2, kv2 = second_d_backend
    monkeypatch.setattr(rig.engines, "d", backend2)
    monkeypatch.setitem(rig.engines.d_kv, HEADS, kv2)
    live = rig.make("decode-2")
    assert held.frozen != backend2.descriptor
    before = {"frozen": snapshot(frozen.kv), "live": snapshot(live.kv)}
    src_a, src_b, dst = [0, 1, 2], [5, 6, 7], [9, 10, 11]
    frozen.mgr.add_recvs([recv_job(rig, "d-a", 601, dst)])
    live.mgr.add_recvs([recv_job(rig, "d-b", 602, dst)])
    wait_for(lambda: p.room_state(601) is p.room_state(602) is RoomState.AWAITING_PREFILL, what="both D requests")
    chunks = [LayerChunk("p-a", 601, tuple(src_a), 0, 3, True), LayerChunk("p-b", 602, tuple(src_b), 0, 3, True)]
    run_step(streams, chunks)  # room 601's first layer is queued first: its write hangs
    assert held.started.wait(WAIT_S)
    live.wait_recv("d-b")
    assert not held.release.is_set() and "d-a" not in frozen.recving  # done while the frozen D's write is held
    assert live.failed == {}
    assert_landed(p, live, before["live"], src_b, dst)
    held.release.set()
    frozen.wait_recv("d-a")
    assert frozen.failed == {}
    assert_landed(p, frozen, before["frozen"], src_a, dst)
    p.mgr.add_sends([SendJob(r, room, s, BLOCK_SIZE * 3) for r, room, s in (("p-a", 601, src_a), ("p-b", 602, src_b))])
    p.wait_sent("p-a")
    p.wait_sent("p-b")
    assert p.idle() and p.stats().transfers_ok == 2


def _held_pair(rig: Rig, monkeypatch: pytest.MonkeyPatch, mode: str) -> tuple[Side, Side, HeldWrites, list[Event]]:
    """P (``transfer_mode`` ``mode``) whose writes to the one D are held, every answer of P logged."""
    events: list[Event] = []
    held = HeldWrites(rig.engines.p.write, events)
    held.frozen = rig.engines.d.descriptor
    monkeypatch.setattr(rig.engines.p, "write", held)
    p = rig.make("prefill", seed=32, transfer_mode=mode)
    d = rig.make("decode")
    _answers(p, events, monkeypatch)
    return p, d, held, events


def _cancel_while_held(
    d: Side, p: Side, held: HeldWrites, events: list[Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM aborts D's request while P's write is held; P handles the cancel; then the write is let go."""
    handled = _cancel_handled(p, events, monkeypatch)
    assert held.started.wait(WAIT_S)
    assert d.mgr.decode is not None
    d.mgr.decode.cancel(["d-req"])
    assert handled.wait(WAIT_S)
    assert not any(kind == "answer" for kind, _ in events), f"answered with the write in flight: {events}"
    held.release.set()
    d.wait_recv("d-req")
    assert "d-req" in d.failed  # D hands its blocks back as failed, after P's answer


def test_a_cancel_during_a_layer_write_is_answered_after_it_returned(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    p, d, held, events = _held_pair(rig, monkeypatch, "layer")
    assert p.mgr.prefill is not None
    streams = p.mgr.prefill.enable_layer_push(_regions(p))
    src, dst = [0, 1, 2], [3, 4, 5]
    d.mgr.add_recvs([recv_job(rig, "d-req", 611, dst)])
    wait_for(lambda: p.room_state(611) is RoomState.AWAITING_PREFILL, what="P to hold D's request")
    run_step(streams, [LayerChunk("p-req", 611, tuple(src), 0, 3, True)])  # every layer queued, the first held
    _cancel_while_held(d, p, held, events, monkeypatch)
    assert _answered_after_the_write(events, "d-req") is DoneStatus.CANCELLED
    assert sum(kind == "write returned" for kind, _ in events) == 1  # the queued layer never reached the backend
    p.mgr.add_sends([SendJob("p-req", 611, src, BLOCK_SIZE * 3)])
    p.wait_sent("p-req")
    assert p.idle() and d.idle()


def test_a_cancel_after_the_prefill_was_aborted_waits_for_the_streams_write(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefill is aborted while a layer write runs (the room leaves P's table, its reader stops
    ABORTED), then D cancels: P does not answer the cancel at once as for a room it does not hold;
    the reader answers, once, after its write returned."""
    p, d, held, events = _held_pair(rig, monkeypatch, "layer")
    assert p.mgr.prefill is not None
    streams = p.mgr.prefill.enable_layer_push(_regions(p))
    src, dst = [0, 1], [3, 4]
    d.mgr.add_recvs([recv_job(rig, "d-req", 612, dst)])
    wait_for(lambda: p.room_state(612) is RoomState.AWAITING_PREFILL, what="P to hold D's request")
    run_step(streams, [LayerChunk("p-req", 612, tuple(src), 0, 2, False)], layers=1)
    assert held.started.wait(WAIT_S)
    p.mgr.drop_rooms([612])
    assert p.room_state(612) is None
    _cancel_while_held(d, p, held, events, monkeypatch)
    assert _answered_after_the_write(events, "d-req") is DoneStatus.ABORTED
    wait_for(lambda: not streams._readers, what="the reader to end")
    assert p.idle() and d.idle()


def test_a_cancel_during_a_request_mode_push_is_answered_after_it_returned(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, d, held, events = _held_pair(rig, monkeypatch, "request")
    src, dst = [0, 1, 2], [3, 4, 5]
    p.mgr.add_sends([SendJob("p-req", 613, src, BLOCK_SIZE * 3)])
    d.mgr.add_recvs([recv_job(rig, "d-req", 613, dst)])
    _cancel_while_held(d, p, held, events, monkeypatch)
    # The push is one write of every layer: in flight, it lands whole, and P says so once it returned.
    assert _answered_after_the_write(events, "d-req") in (DoneStatus.OK, DoneStatus.CANCELLED)
    p.wait_sent("p-req")
    assert p.idle() and d.idle()


def _regions(p: Side) -> dict[str, range]:
    from pd_connector.transfer.layerwise import layer_regions_of

    return layer_regions_of(p.kv, [1] * len(p.kv))
