"""No write after free: a slow push never lands a byte in a D block after D handed the
block back to vLLM (``finished_recving``, failed), when vLLM could give it to another request.

A real prefill and decode KVTransferManager (tests/support/transfer_rig.py: real ZMQ, bootstrap server,
in-process backend); P's backend is made slow per batch and records, per D block, when each write into
it finished; D's outbox records when each request was handed back. Every write must have landed before
the hand-back. DecodeSide's bookkeeping with two P ranks (one fails, one still writes) is checked on
its own with a recording context.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pd_connector import messages as proto
from pd_connector.config import parse_config
from pd_connector.messages import DoneStatus
from pd_connector.metadata import RecvJob, SendJob
from pd_connector.scheduling.layer_chunks import LayerChunk
from pd_connector.trace import TraceBook
from pd_connector.transfer import decode_side as decode_side_module
from pd_connector.transfer.backend import WRITE_RETRIES, Ints, Wanted, write_in_batches
from pd_connector.transfer.context import RankContext, RankSpec
from pd_connector.transfer.decode_side import DecodeSide
from pd_connector.transfer.layerwise import layer_regions_of
from pd_connector.transfer.loads import Load, stop_wait_s
from pd_connector.transfer.outbox import Outbox
from pd_connector.transfer.states import LoadState, RoomState
from pd_connector.transfer.stats import TransferStats
from tests.support.loopback import wait_for
from tests.support.transfer_rig import BLOCK_SIZE, LAYERS, NUM_BLOCKS, Rig, Side, recv_job

P_BLOCKS, D_BLOCKS = [2, 4, 6, 8], [1, 3, 5, 7]  # not contiguous: one entry per block and layer (8 in all)


class SlowWrites:
    """P's backend write, one entry per batch, each batch ``delay_s`` (or until ``gate`` opens) before it
    lands; records (time it landed, D address, length) of every entry."""

    def __init__(self, inner: Callable[..., None], delay_s: float, gate: threading.Event | None = None) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.gate = gate
        self.landed: list[tuple[float, int, int]] = []
        self.started = threading.Event()

    def __call__(
        self, peer: bytes, src: Ints, dst: Ints, lengths: Ints, max_batch: int, still_wanted: Wanted = None
    ) -> None:
        def batch(s: list[int], d: list[int], n: list[int]) -> int:
            self.started.set()
            if self.gate is not None:
                self.gate.wait(30)
            time.sleep(self.delay_s)
            self.inner(peer, s, d, n, len(s))  # the bytes move here
            now = time.monotonic()
            self.landed += [(now, addr, length) for addr, length in zip(d, n, strict=True)]
            return 0

        write_in_batches(batch, src, dst, lengths, 1, still_wanted, what="slow write", peer=peer.decode())

    def blocks(self, kv: dict[str, torch.Tensor]) -> list[tuple[float, int]]:
        """(when it landed, D block) of every entry written into ``kv``."""
        out = []
        for t in kv.values():
            base, size = t.data_ptr(), t[0].numel() * t.element_size()
            for at, addr, length in self.landed:
                if base <= addr < base + NUM_BLOCKS * size:
                    out += [(at, b) for b in range((addr - base) // size, (addr - base + length - 1) // size + 1)]
        return out


class Handbacks:
    """D's outbox.received, timed: when each request (and its blocks) went back to vLLM."""

    def __init__(self, side: Side) -> None:
        self.inner = side.mgr.outbox.received
        self.at: dict[str, tuple[float, list[int] | None]] = {}

    def __call__(self, req_id: str, failed_blocks: list[int] | None = None) -> None:
        self.at[req_id] = (time.monotonic(), failed_blocks)
        self.inner(req_id, failed_blocks)


def _slow_pair(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, delay_s: float, gate: threading.Event | None = None, **d_extra: Any
) -> tuple[Side, Side, SlowWrites, Handbacks]:
    slow = SlowWrites(rig.engines.p.write, delay_s, gate)
    monkeypatch.setattr(rig.engines.p, "write", slow)
    p = rig.make("prefill")
    d = rig.make("decode", **d_extra)
    hand = Handbacks(d)
    monkeypatch.setattr(d.mgr.outbox, "received", hand)
    return p, d, slow, hand


def _start(rig: Rig, p: Side, d: Side, room: int) -> None:
    p.mgr.add_sends([SendJob("p-1", room, P_BLOCKS, BLOCK_SIZE * len(P_BLOCKS))])
    d.mgr.add_recvs([recv_job(rig, "d-1", room, D_BLOCKS)])


def _assert_nothing_landed_after(slow: SlowWrites, d: Side, handed_back: float) -> None:
    writes = [(at, b) for at, b in slow.blocks(d.kv) if b in D_BLOCKS]
    assert writes, "the slow push wrote nothing: the test proves nothing"
    late = [(round(at - handed_back, 3), b) for at, b in writes if at > handed_back]
    assert late == [], f"bytes landed in D blocks after D handed them back to vLLM: {late}"


def test_a_cancel_waits_for_the_batch_in_flight(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM aborts the request while P is in a 3 s batch (longer than the old 2 s cancel grace): D hands
    the blocks back only after that batch landed and P answered, and P starts no further batch."""
    p, d, slow, hand = _slow_pair(rig, monkeypatch, 3.0)
    _start(rig, p, d, 7101)
    assert slow.started.wait(10)  # P is inside its first batch
    t_cancel = time.monotonic()
    assert d.mgr.decode is not None
    d.mgr.decode.cancel(["d-1"])
    d.wait_recv("d-1", timeout=20)
    p.wait_sent("p-1", timeout=30)  # P's push ended: every write it made has landed
    handed_back, failed = hand.at["d-1"]
    assert failed == D_BLOCKS  # handed back as failed: vLLM never caches or reads them
    _assert_nothing_landed_after(slow, d, handed_back)
    assert handed_back - t_cancel > 2.0  # waited past the old grace: the batch was still landing
    assert len(slow.landed) == 1  # the batch in flight landed; no other batch started after the cancel


def test_a_timed_out_load_keeps_its_blocks_until_p_stopped(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_wait_timeout_s ends the load while P is still pushing (8 batches of 0.4 s): D tells P to stop
    and hands the blocks back once P answered; P stopped between batches, well before its end."""
    p, d, slow, hand = _slow_pair(rig, monkeypatch, 0.4, kv_wait_timeout_s=1.0)
    t0 = time.monotonic()
    _start(rig, p, d, 7102)
    d.wait_recv("d-1", timeout=20)
    p.wait_sent("p-1", timeout=30)  # P's push ended: every write it made has landed
    handed_back, failed = hand.at["d-1"]
    assert failed == D_BLOCKS and d.failed == {"d-1": D_BLOCKS}
    assert handed_back - t0 >= 1.0
    _assert_nothing_landed_after(slow, d, handed_back)
    assert len(slow.landed) < 8  # P stopped between batches


def test_a_p_that_never_answers_is_waited_for_the_stated_bound(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, pd_logs: pytest.LogCaptureFixture
) -> None:
    """P's write hangs and P never answers the cancel: D hands the blocks back after stop_wait_s, not sooner."""
    monkeypatch.setattr(decode_side_module, "stop_wait_s", lambda cfg, timing=None: 1.5)
    gate = threading.Event()
    p, d, slow, hand = _slow_pair(rig, monkeypatch, 0.0, gate)
    _start(rig, p, d, 7103)
    assert slow.started.wait(10)
    t_cancel = time.monotonic()
    assert d.mgr.decode is not None
    d.mgr.decode.cancel(["d-1"])
    d.wait_recv("d-1", timeout=20)
    assert hand.at["d-1"][0] - t_cancel >= 1.5
    assert "prefill did not answer within 1.5 s" in pd_logs.text
    gate.set()  # let P's write end so the rig can close
    p.wait_sent("p-1")


def test_layer_mode_stops_between_batches_and_layers(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """transfer_mode "layer": both layers' writes are queued on P's writer (3 batches of 0.5 s each); vLLM
    aborts during the first: the batch in flight lands, no later batch or layer does, and D hands the
    blocks back only after that."""
    slow = SlowWrites(rig.engines.p.write, 0.5)
    monkeypatch.setattr(rig.engines.p, "write", slow)
    p = rig.make("prefill", transfer_mode="layer")
    d = rig.make("decode")
    hand = Handbacks(d)
    monkeypatch.setattr(d.mgr.outbox, "received", hand)
    assert p.mgr.prefill is not None and d.mgr.decode is not None
    streams = p.mgr.prefill.enable_layer_push(layer_regions_of(p.kv, [1] * LAYERS))
    src, dst = [2, 4, 6], [1, 3, 5]
    d.mgr.add_recvs([recv_job(rig, "d-1", 7104, dst)])
    wait_for(lambda: p.room_state(7104) is RoomState.AWAITING_PREFILL, 10, what="P to hold D's request")
    step, chunks = object(), [LayerChunk("p-1", 7104, tuple(src), 0, 3, True)]
    for name in streams._layers:
        streams.on_layer(chunks, step, name)
    assert slow.started.wait(10)
    d.mgr.decode.cancel(["d-1"])
    d.wait_recv("d-1", timeout=20)
    wait_for(lambda: not streams._readers, 10, what="the reader to end")
    streams.on_forward_end(chunks, step)
    p.mgr.add_sends([SendJob("p-1", 7104, src, BLOCK_SIZE * len(src))])
    p.wait_sent("p-1", timeout=20)
    time.sleep(0.6)  # a write still queued would land by now
    handed_back = hand.at["d-1"][0]
    writes = [(at, b) for at, b in slow.blocks(d.kv) if b in dst]
    assert writes and all(at <= handed_back for at, _ in writes), (writes, handed_back)
    assert len(slow.landed) < 2 * len(src)  # stopped: not every batch of both layers was written


def test_the_stated_bound_outlasts_p_slowest_batch() -> None:
    cfg = parse_config("kv_consumer", {})
    slowest_batch = (1 + WRITE_RETRIES) * cfg.backend_options.batch_stall_s  # tests/unit/test_timing_contract.py
    assert stop_wait_s(cfg) > slowest_batch + cfg.peer_timeout_s


# ----------------------------------------------------- DecodeSide with two P ranks


A, B = "tcp://127.0.0.1:5001", "tcp://127.0.0.1:5002"


def _decode_with_load() -> tuple[DecodeSide, Outbox, list[tuple[str, proto.Message]]]:
    cfg = parse_config("kv_consumer", {"local_ip": "127.0.0.1"})
    spec = RankSpec(tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, block_size=16, kv_dtype="float16", num_layers=2)
    sent: list[tuple[str, proto.Message]] = []
    outbox = Outbox()
    ctx = RankContext(
        cfg, spec, [], lambda ep, msg: sent.append((ep, msg)), lambda fn, *a: fn(*a), TransferStats("t"), outbox,
        TraceBook("decode", enabled=False),
    )  # fmt: skip
    side = DecodeSide(ctx, b"d", "d-peer", "tcp://127.0.0.1:6000")
    job = RecvJob("d-1", 9, "127.0.0.1", 1, None, [3, 4], 0, 32)
    load = Load(job, time.monotonic() + 60, LoadState.AWAITING_KV, [A, B], {A: 0, B: 1}, p_tp=2)
    side._loads["d-1"] = load
    return side, outbox, sent


def _done(tp_rank: int, status: DoneStatus) -> proto.TransferDone:
    return proto.TransferDone(
        room=9, request_id="d-1", tp_rank=tp_rank, status=status, nbytes=64 if status == 0 else -1
    )


def test_one_p_rank_failing_waits_for_the_other_to_stop() -> None:
    side, outbox, sent = _decode_with_load()
    side.on_done(_done(0, DoneStatus.TRANSFER_FAILED))
    assert outbox.take() == (set(), set(), {})  # rank 1 may still be writing: not handed back
    assert [(ep, type(m).__name__) for ep, m in sent] == [(B, "TransferCancel")]  # only the rank still writing
    side.on_done(_done(1, DoneStatus.CANCELLED))  # rank 1 stopped
    assert outbox.take() == (set(), {"d-1"}, {"d-1": [3, 4]})
    assert side.loads_waiting() == 0


def test_a_lost_p_rank_is_told_to_stop_and_the_bound_ends_the_wait() -> None:
    """A silent P rank may only be cut off from answering: it gets the cancel and the load holds its
    blocks (tests/unit/test_lost_peer_wait.py: the wait and P's late answer)."""
    side, outbox, sent = _decode_with_load()
    side.on_done(_done(1, DoneStatus.OK))  # rank 1 finished its write
    side.peer_lost(A, 5.0)  # rank 0 went silent: it may still be writing
    assert outbox.take() == (set(), set(), {}) and [(ep, type(m).__name__) for ep, m in sent] == [(A, "TransferCancel")]
    side, outbox, sent = _decode_with_load()
    side.expire(time.monotonic() + 61)  # kv_wait_timeout_s: both ranks told to stop
    assert {ep for ep, _ in sent} == {A, B} and outbox.take() == (set(), set(), {})
    assert side.peers_waited_on() == {A, B}  # liveness keeps watching them meanwhile
    side.expire(time.monotonic() + 61 + stop_wait_s(side._cfg))
    assert outbox.take()[2] == {"d-1": [3, 4]}
