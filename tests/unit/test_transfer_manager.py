"""KVTransferManager: a prefill and a decode manager, real ZMQ and a real bootstrap server, all in
this process on loopback (the rig: tests/support/transfer_rig.py, its fixtures in conftest.py).
KV: 2 layers x 16 blocks, vLLM CPU layout; the in-process backend by default, real Mooncake TCP
where a test is marked BOTH_BACKENDS."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from pd_connector import messages as proto
from pd_connector.messages import DoneStatus
from pd_connector.metadata import SendJob
from pd_connector.transfer.backend import TransferBackend
from pd_connector.transfer.registry import known_backends
from pd_connector.transfer.states import LoadState, RoomState
from tests.support.inproc_backend import InprocBackend
from tests.support.loopback import HOST, free_port, wait_for
from tests.support.transfer_rig import BLOCK_SIZE, BOTH_BACKENDS, HEADS, LAYERS, Rig, assert_landed, recv_job, snapshot

# ------------------------------------------------------------------ happy paths


@BOTH_BACKENDS
def test_decode_first_then_prefill(rig: Rig) -> None:
    p = rig.make("prefill", seed=1)
    d = rig.make("decode")
    before = snapshot(d.kv)
    src, dst = [0, 1, 2, 7, 8], [5, 6, 9, 3, 4]
    d.mgr.add_recvs([recv_job(rig, "d-req", 101, dst)])
    wait_for(lambda: p.room_state(101) is RoomState.AWAITING_PREFILL, what="P to hold D's transfer request")
    assert not d.recving and not p.sending
    p.mgr.add_sends([SendJob("p-req", 101, src, BLOCK_SIZE * len(src))])
    d.wait_recv("d-req")
    p.wait_sent("p-req")
    assert d.failed == {} and d.recving == {"d-req"} and p.sending == {"p-req"}
    assert_landed(p, d, before, src, dst)
    # Runs (0,5,2), (2,9,1), (7,3,2) -> 3 entries per region, 2 regions.
    assert p.stats().transfers_ok == 1 and p.stats().transfers_failed == 0
    assert p.stats().entries_sent == 3 * LAYERS
    assert p.stats().bytes_sent == len(src) * LAYERS * p.mgr.regions[0].block_bytes
    assert d.stats().recvs_ok == 1 and d.stats().recvs_failed == 0
    assert p.idle() and d.idle()
    assert p.settled() and d.settled()


def test_prefill_first_then_decode_with_local_prefix(rig: Rig) -> None:
    p = rig.make("prefill", seed=2)
    d = rig.make("decode")
    before = snapshot(d.kv)
    src = [3, 4, 5, 6, 9, 10]
    p.mgr.add_sends([SendJob("p-req", 202, src, 90)])
    assert p.room_state(202) is RoomState.READY
    # D already has the first two blocks locally: it asks for P's blocks 2.. only.
    dst = [12, 13, 14, 15]
    d.mgr.add_recvs([recv_job(rig, "d-req", 202, dst, start_block=2, dp_rank=0, num_tokens=90)])
    d.wait_recv("d-req")
    p.wait_sent("p-req")
    assert d.failed == {}
    assert_landed(p, d, before, src[2:], dst)
    assert p.stats().entries_sent == 2 * LAYERS  # runs (5,12,2), (9,14,2)
    assert p.idle() and d.idle()


@BOTH_BACKENDS
def test_many_rooms_both_orders_and_small_batches(rig: Rig) -> None:
    p = rig.make("prefill", seed=3, max_batch_entries=2)
    d = rig.make("decode")
    before = snapshot(d.kv)
    plan = {  # room: (src, dst)
        1: ([0, 2, 4], [1, 3, 5]),  # nothing coalesces: 3 entries per region, 3 batches of <= 2
        2: ([6, 7], [8, 9]),
        3: ([10, 11, 12], [10, 11, 12]),
    }
    d.mgr.add_recvs([recv_job(rig, f"d{room}", room, dst) for room, (_, dst) in plan.items() if room != 2])
    wait_for(lambda: p.room_state(1) is p.room_state(3) is RoomState.AWAITING_PREFILL)
    p.mgr.add_sends([SendJob(f"p{room}", room, src, 48) for room, (src, _) in plan.items()])
    d.mgr.add_recvs([recv_job(rig, "d2", 2, plan[2][1])])
    for room in plan:
        d.wait_recv(f"d{room}")
        p.wait_sent(f"p{room}")
    assert d.failed == {}
    all_src = [b for src, _ in plan.values() for b in src]
    all_dst = [b for _, dst in plan.values() for b in dst]
    assert_landed(p, d, before, all_src, all_dst)
    assert p.stats().transfers_ok == 3
    assert p.mgr.prefill is not None and len(p.mgr.prefill._peers) == 1  # one PeerHello for all requests


def test_full_local_hit_frees_the_room_without_writing(rig: Rig) -> None:
    p = rig.make("prefill", seed=4)
    d = rig.make("decode")
    before = snapshot(d.kv)
    p.mgr.add_sends([SendJob("p-req", 303, [0, 1], 32)])
    d.mgr.add_recvs([recv_job(rig, "d-req", 303, [], start_block=2, num_tokens=32)])
    d.wait_recv("d-req")
    p.wait_sent("p-req")
    assert d.failed == {}
    assert p.stats().bytes_sent == 0
    for name in d.kv:
        assert torch.equal(d.kv[name], before[name])


# ------------------------------------------------------------ failures / timeouts


def test_decode_times_out_when_prefill_never_has_the_room(rig: Rig) -> None:
    p = rig.make("prefill", seed=5)
    d = rig.make("decode", kv_wait_timeout_s=3.0)  # long enough for P to see the request on a busy box
    dst = [4, 5, 6]
    t0 = time.monotonic()
    d.mgr.add_recvs([recv_job(rig, "d-req", 404, dst)])
    wait_for(lambda: p.room_state(404) is RoomState.AWAITING_PREFILL, what="P to hold D's transfer request")
    d.wait_recv("d-req")
    elapsed = time.monotonic() - t0
    assert 2.9 <= elapsed < 15, elapsed
    assert d.failed == {"d-req": dst}
    assert d.stats().recvs_failed == 1 and d.stats().recvs_ok == 0
    # D's TransferCancel clears P's pending request: nothing lingers until P's own room timeout.
    wait_for(p.idle, timeout=10, what="P to drop the cancelled request")
    p.poll()
    assert p.sending == set() and p.settled()
    assert d.idle()


def test_prefill_room_nobody_asks_for_is_freed(rig: Rig, pd_logs: pytest.LogCaptureFixture) -> None:
    p = rig.make("prefill", seed=6, room_timeout_s=1.0)
    d = rig.make("decode")
    t0 = time.monotonic()
    p.mgr.add_sends([SendJob("p-req", 505, [1, 2], 32)])
    p.wait_sent("p-req")
    assert 0.9 <= time.monotonic() - t0 < 10
    assert p.stats().rooms_expired == 1 and p.stats().transfers_ok == 0
    assert p.idle()
    assert "no decode asked for this KV within 1 s" in pd_logs.text
    # A D that shows up late fails at once with the reason, instead of waiting for its timeout.
    t1 = time.monotonic()
    d.mgr.add_recvs([recv_job(rig, "d-late", 505, [3, 4])])
    d.wait_recv("d-late")
    assert time.monotonic() - t1 < 10  # not kv_wait_timeout_s (30 s)
    assert d.failed == {"d-late": [3, 4]}
    assert "freed the KV after waiting 1 s" in pd_logs.text


def test_dropped_room_fails_decode_fast(rig: Rig, pd_logs: pytest.LogCaptureFixture) -> None:
    p = rig.make("prefill", seed=7)
    d = rig.make("decode")
    p.mgr.drop_rooms([606])
    t0 = time.monotonic()
    d.mgr.add_recvs([recv_job(rig, "d-req", 606, [1, 2])])
    d.wait_recv("d-req")
    assert time.monotonic() - t0 < 10  # far below kv_wait_timeout_s (30 s)
    assert d.failed == {"d-req": [1, 2]}
    assert "aborted" in pd_logs.text
    p.poll()
    assert p.sending == set() and p.idle()


def test_a_reused_room_is_served_again_when_its_new_prefill_comes(rig: Rig) -> None:
    """A client that sends the same room twice: D's second request may reach P before P's second prefill."""
    p = rig.make("prefill", seed=9)
    d = rig.make("decode")
    p.mgr.add_sends([SendJob("p-req-1", 808, [1, 2], 2 * BLOCK_SIZE)])
    d.mgr.add_recvs([recv_job(rig, "d-req-1", 808, [3, 4])])
    d.wait_recv("d-req-1")
    p.wait_sent("p-req-1")
    # Same room again, D first: P holds the request for a short grace instead of refusing at once.
    before = snapshot(d.kv)
    d.mgr.add_recvs([recv_job(rig, "d-req-2", 808, [5, 6])])
    wait_for(lambda: p.room_state(808) is RoomState.AWAITING_PREFILL, what="P to hold D's second request")
    p.mgr.add_sends([SendJob("p-req-2", 808, [7, 8], 2 * BLOCK_SIZE)])
    d.wait_recv("d-req-2")
    p.wait_sent("p-req-2")
    assert d.failed == {}
    assert_landed(p, d, before, [7, 8], [5, 6])
    assert p.idle() and d.idle()


def test_drop_after_decode_asked_fails_decode(rig: Rig, pd_logs: pytest.LogCaptureFixture) -> None:
    p = rig.make("prefill", seed=8)
    d = rig.make("decode")
    d.mgr.add_recvs([recv_job(rig, "d-req", 607, [9])])
    wait_for(lambda: p.room_state(607) is RoomState.AWAITING_PREFILL)
    p.mgr.drop_rooms([607])
    d.wait_recv("d-req")
    assert d.failed == {"d-req": [9]}
    assert "prefill request was aborted" in pd_logs.text
    assert p.idle()


def test_garbage_frames_are_dropped(rig: Rig) -> None:
    p = rig.make("prefill", seed=9)
    d = rig.make("decode")
    good = proto.encode(proto.TransferCancel(room=1, request_id="x"))
    frames = [
        b"",
        b"\x00\x01garbage",
        good[:-3],  # truncated
        proto.msgspec.msgpack.encode({"type": "xfer", "room": "nope"}),  # wrong shape
        proto.msgspec.msgpack.encode([1, 2, 3]),
    ]
    ctx = zmq.Context()
    try:
        for target in (p, d):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(target.mgr.endpoint)
            for frame in frames:
                sock.send(frame)
            sock.send_multipart([b"multi", b"part"])  # two more bad frames
            wait_for(lambda t=target: t.stats().bad_frames == len(frames) + 2, timeout=5, what="bad frames")
            sock.close(linger=0)
    finally:
        ctx.term()
    assert p.mgr.channel.listening and d.mgr.channel.listening
    for side in (p, d):  # counted for /metrics on their own: no transfer failed
        interval = side.mgr.stats.take_interval()
        assert interval is not None and interval["bad_frames"] == len(frames) + 2
        assert not any(interval["failures"].values())
    before = snapshot(d.kv)
    d.mgr.add_recvs([recv_job(rig, "d-req", 707, [0, 1])])
    p.mgr.add_sends([SendJob("p-req", 707, [14, 15], 32)])
    d.wait_recv("d-req")
    p.wait_sent("p-req")
    assert d.failed == {}
    assert_landed(p, d, before, [14, 15], [0, 1])


def test_decode_block_size_mismatch_fails(rig: Rig, pd_logs: pytest.LogCaptureFixture) -> None:
    p = rig.make("prefill", seed=10)
    d = rig.make("decode", block_size=BLOCK_SIZE * 2)
    before = snapshot(d.kv)
    p.mgr.add_sends([SendJob("p-req", 808, [0, 1], 32)])
    t0 = time.monotonic()
    d.mgr.add_recvs([recv_job(rig, "d-req", 808, [2, 3])])
    d.wait_recv("d-req")
    assert time.monotonic() - t0 < 10
    assert d.failed == {"d-req": [2, 3]}
    assert "block size" in pd_logs.text
    for name in d.kv:
        assert torch.equal(d.kv[name], before[name])


def test_decode_of_another_model_fails(fresh_rig: Rig, pd_logs: pytest.LogCaptureFixture) -> None:
    p = fresh_rig.make("prefill", seed=11, model="LlamaForCausalLM layers=2 hidden=128")
    d = fresh_rig.make("decode", model="LlamaForCausalLM layers=2 hidden=256")
    before = snapshot(d.kv)
    p.mgr.add_sends([SendJob("p-req", 809, [0, 1], 32)])
    d.mgr.add_recvs([recv_job(fresh_rig, "d-req", 809, [2, 3])])
    d.wait_recv("d-req")
    assert d.failed == {"d-req": [2, 3]}
    assert "model mismatch" in pd_logs.text and "hidden=128" in pd_logs.text and "hidden=256" in pd_logs.text
    for name in d.kv:
        assert torch.equal(d.kv[name], before[name])


def test_incompatible_decode_layout_fails_and_prefill_frees(rig: Rig, pd_logs: pytest.LogCaptureFixture) -> None:
    """Same block size/dtype/layers (the route check passes) but other bytes per block: P refuses."""
    p = rig.make("prefill", seed=11)
    d = rig.make("decode", heads=HEADS * 2)
    before = snapshot(d.kv)
    p.mgr.add_sends([SendJob("p-req", 909, [0, 1], 32)])
    d.mgr.add_recvs([recv_job(rig, "d-req", 909, [2, 3])])
    d.wait_recv("d-req")
    p.wait_sent("p-req")  # P frees its blocks even though the push failed
    assert d.failed == {"d-req": [2, 3]}
    assert p.stats().transfers_failed == 1
    assert "incompatible decode instance" in pd_logs.text
    for name in d.kv:
        assert torch.equal(d.kv[name], before[name])


def test_decode_asks_for_more_blocks_than_prefill_holds(rig: Rig, pd_logs: pytest.LogCaptureFixture) -> None:
    p = rig.make("prefill", seed=12)
    d = rig.make("decode")
    p.mgr.add_sends([SendJob("p-req", 1001, [0, 1], 32)])
    d.mgr.add_recvs([recv_job(rig, "d-req", 1001, [2, 3, 4])])
    d.wait_recv("d-req")
    p.wait_sent("p-req")
    assert d.failed == {"d-req": [2, 3, 4]}
    assert "prompts differ" in pd_logs.text


def test_bootstrap_unreachable_fails_fast(rig: Rig, pd_logs: pytest.LogCaptureFixture) -> None:
    d = rig.make("decode")
    dead = free_port()
    t0 = time.monotonic()
    d.mgr.add_recvs([recv_job(rig, "d-req", 1101, [0, 1], port=dead)])
    d.wait_recv("d-req")
    assert time.monotonic() - t0 < 10  # not kv_wait_timeout_s (30 s)
    assert d.failed == {"d-req": [0, 1]}
    assert f"bootstrap server {HOST}:{dead} unreachable" in pd_logs.text
    assert d.idle()


def test_prefill_not_registered_fails_within_half_the_kv_wait(
    fresh_rig: Rig, pd_logs: pytest.LogCaptureFixture
) -> None:
    """A deployment whose ranks never register: D retries the route for half its KV wait, then fails."""
    rig = fresh_rig
    rig.make("prefill", seed=13, register=False)
    d = rig.make("decode", kv_wait_timeout_s=6.0)
    t0 = time.monotonic()
    d.mgr.add_recvs([recv_job(rig, "d-req", 1201, [0])])
    d.wait_recv("d-req", timeout=20.0)
    assert time.monotonic() - t0 < 6.0
    assert d.failed == {"d-req": [0]}
    assert "not ready" in pd_logs.text


# ------------------------------------------------------------ backends and states


def test_a_registered_backend_runs_a_push(rig: Rig) -> None:
    """The in-process backend, registered as "inproc" through the registry, carries a real P->D push."""
    assert "inproc" in known_backends() and "mooncake" in known_backends()
    p = rig.make("prefill", seed=21)
    d = rig.make("decode")
    assert p.mgr.cfg.backend == d.mgr.cfg.backend == "inproc"
    assert isinstance(rig.engines.p, InprocBackend) and isinstance(rig.engines.p, TransferBackend)
    batches = rig.engines.p.batches
    before = snapshot(d.kv)
    src, dst = [4, 5, 6, 11], [0, 1, 2, 8]
    p.mgr.add_sends([SendJob("p-req", 2101, src, 4 * BLOCK_SIZE)])
    d.mgr.add_recvs([recv_job(rig, "d-req", 2101, dst)])
    d.wait_recv("d-req")
    p.wait_sent("p-req")
    assert d.failed == {}
    assert_landed(p, d, before, src, dst)
    assert rig.engines.p.batches == batches + 1  # 2 runs x 2 regions: one batch
    assert p.stats().entries_sent == 2 * LAYERS


def test_unknown_peer_status_makes_decode_introduce_itself_again(rig: Rig, pd_logs: pytest.LogCaptureFixture) -> None:
    """P that lost its peers (a restart on the same port) answers UNKNOWN_PEER; D says hello again."""
    p = rig.make("prefill", seed=22)
    d = rig.make("decode")
    p.mgr.add_sends([SendJob("p-1", 2201, [0], BLOCK_SIZE)])
    d.mgr.add_recvs([recv_job(rig, "d-1", 2201, [1])])
    d.wait_recv("d-1")
    assert p.mgr.prefill is not None and d.mgr.decode is not None
    with p.mgr.prefill._lock:
        p.mgr.prefill._peers.clear()
    p.mgr.add_sends([SendJob("p-2", 2202, [2], BLOCK_SIZE)])
    t0 = time.monotonic()
    d.mgr.add_recvs([recv_job(rig, "d-2", 2202, [3])])
    d.wait_recv("d-2")
    assert time.monotonic() - t0 < 10  # answered, not left to D's 30 s KV wait
    assert d.failed == {"d-2": [3]}
    assert "unknown decode peer" in pd_logs.text and "UNKNOWN_PEER" in pd_logs.text
    before = snapshot(d.kv)
    p.mgr.add_sends([SendJob("p-3", 2203, [4, 5], 2 * BLOCK_SIZE)])
    d.mgr.add_recvs([recv_job(rig, "d-3", 2203, [6, 7])])
    d.wait_recv("d-3")
    assert "d-3" not in d.failed
    assert_landed(p, d, before, [4, 5], [6, 7])


def test_decode_acts_on_the_status_not_the_error_text(rig: Rig) -> None:
    d = rig.make("decode")
    assert d.mgr.decode is not None
    side = d.mgr.decode
    with side._hello_lock:
        side._hello_sent.add("tcp://127.0.0.1:1")
    text = "unknown decode peer x (no PeerHello received)"
    side.on_done(proto.TransferDone(room=1, request_id="nobody", tp_rank=0, status=DoneStatus.TIMEOUT, error=text))
    assert side._hello_sent == {"tcp://127.0.0.1:1"}
    side.on_done(proto.TransferDone(room=1, request_id="nobody", tp_rank=0, status=DoneStatus.UNKNOWN_PEER))
    assert side._hello_sent == set()


def test_load_states_resolving_then_awaiting_kv(rig: Rig) -> None:
    p = rig.make("prefill", seed=23)
    d = rig.make("decode")
    assert d.mgr.decode is not None
    d.mgr.add_recvs([recv_job(rig, "d-req", 2301, [1, 2])])
    with d.mgr.decode._lock:
        assert d.mgr.decode._loads["d-req"].state in (LoadState.RESOLVING, LoadState.AWAITING_KV)
    wait_for(lambda: p.room_state(2301) is RoomState.AWAITING_PREFILL, what="P to hold D's request")
    with d.mgr.decode._lock:
        load = d.mgr.decode._loads["d-req"]
        assert load.state is LoadState.AWAITING_KV and len(load.endpoints) == 1
    p.mgr.add_sends([SendJob("p-req", 2301, [3, 4], 2 * BLOCK_SIZE)])
    d.wait_recv("d-req")
    assert load.state is LoadState.RECEIVED and d.idle()
