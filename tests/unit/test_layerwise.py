"""Layer-wise push (transfer_mode "layer"): a P manager whose LayerStreams is fed a prefill's
save_kv_layer calls step by step, a D manager, real ZMQ and bootstrap, the in-process backend
(Mooncake TCP where parametrized). D's request comes before, during or after the prefill."""

from __future__ import annotations

import threading

import pytest
import torch

from pd_connector.messages import DoneStatus
from pd_connector.metadata import SendJob
from pd_connector.transfer.layerwise import enable_layer_push
from pd_connector.transfer.states import RoomState
from tests.support.layer_streams import chunk, layer_mode, run_step
from tests.support.loopback import wait_for
from tests.support.transfer_rig import (
    BLOCK_SIZE,
    BOTH_BACKENDS,
    LAYERS,
    NUM_BLOCKS,
    Rig,
    Side,
    assert_landed,
    recv_job,
    snapshot,
)


def finish_prefill(p: Side, room: int, src: list[int]) -> None:
    """P's scheduler saw the request finish: its SendJob; the room is freed once served."""
    p.mgr.add_sends([SendJob("p-req", room, src, BLOCK_SIZE * len(src))])
    p.wait_sent("p-req")


@BOTH_BACKENDS
def test_decode_first_then_chunked_prefill_streams_every_layer(rig: Rig) -> None:
    p, streams = layer_mode(rig, seed=11)
    d = rig.make("decode")
    before = snapshot(d.kv)
    src, dst = [0, 1, 2, 7, 8], [5, 6, 9, 3, 4]
    d.mgr.add_recvs([recv_job(rig, "d-req", 501, dst)])
    wait_for(lambda: p.room_state(501) is RoomState.AWAITING_PREFILL, what="P to hold D's request")
    run_step(streams, [chunk(501, src, 0, 2, final=False)])  # chunk 1 fills blocks 0, 1
    run_step(streams, [chunk(501, src, 2, 5, final=True)])  # chunk 2: the rest, last block partial
    d.wait_recv("d-req")  # before P's scheduler reported the request finished
    assert d.failed == {} and not p.sending
    assert_landed(p, d, before, src, dst)
    finish_prefill(p, 501, src)
    assert p.stats().transfers_ok == 1
    assert p.stats().bytes_sent == len(src) * LAYERS * p.mgr.regions[0].block_bytes
    assert p.idle() and d.idle() and p.settled() and d.settled()


def test_decode_asking_past_the_prompt_is_refused_without_writing(rig: Rig) -> None:
    p, streams = layer_mode(rig, seed=12)
    d = rig.make("decode")
    before = snapshot(d.kv)
    src, dst = [4, 5, 6, 10], [1, 2, 3, 12]
    step = object()
    first = [chunk(502, src, 0, 3, final=True)]
    streams.on_layer(first, step, streams._layers[0])  # layer 0 done before D asks
    d.mgr.add_recvs([recv_job(rig, "d-req", 502, dst[1:], start_block=1)])  # D has block 0 locally
    # The request needs 4 blocks, the stream's final chunk says 3: D asks past the prompt.
    d.wait_recv("d-req")
    for name in streams._layers[1:]:
        streams.on_layer(first, step, name)
    streams.on_forward_end(first, step)
    assert "d-req" in d.failed  # BAD_REQUEST: nothing written into D
    assert torch.equal(d.kv[streams._layers[0]], before[streams._layers[0]])
    assert p.stats().transfers_failed == 1


def test_decode_asks_mid_prefill_backlog_then_live(rig: Rig) -> None:
    p, streams = layer_mode(rig, seed=13)
    d = rig.make("decode")
    before = snapshot(d.kv)
    src, dst = [4, 5, 6, 10], [1, 2, 3, 12]
    step = object()
    chunks = [chunk(503, src, 0, 4, final=True)]
    streams.on_layer(chunks, step, streams._layers[0])
    d.mgr.add_recvs([recv_job(rig, "d-req", 503, dst[1:], start_block=1)])
    wait_for(lambda: 503 in {r.stream.room for r in streams._readers.values()}, what="the stream to take it")
    for name in streams._layers[1:]:
        streams.on_layer(chunks, step, name)
    d.wait_recv("d-req")
    assert d.failed == {}
    assert_landed(p, d, before, src[1:], dst[1:])
    finish_prefill(p, 503, src)
    assert p.idle() and d.idle()


def test_decode_asks_after_the_forward_before_the_send_job(rig: Rig) -> None:
    p, streams = layer_mode(rig, seed=14)
    d = rig.make("decode")
    before = snapshot(d.kv)
    src, dst = [2, 3], [8, 9]
    run_step(streams, [chunk(504, src, 0, 2, final=True)])  # nobody asked yet
    d.mgr.add_recvs([recv_job(rig, "d-req", 504, dst)])
    d.wait_recv("d-req")
    assert d.failed == {} and not p.sending
    assert_landed(p, d, before, src, dst)
    finish_prefill(p, 504, src)
    assert p.idle()


def test_decode_asks_after_the_send_job_gets_a_request_mode_push(rig: Rig) -> None:
    p, streams = layer_mode(rig, seed=15)
    d = rig.make("decode")
    before = snapshot(d.kv)
    src, dst = [2, 3, 4], [8, 9, 10]
    run_step(streams, [chunk(505, src, 0, 3, final=True)])
    p.mgr.add_sends([SendJob("p-req", 505, src, BLOCK_SIZE * 3)])
    assert p.room_state(505) is RoomState.READY and 505 not in streams._streams
    d.mgr.add_recvs([recv_job(rig, "d-req", 505, dst)])
    d.wait_recv("d-req")
    p.wait_sent("p-req")
    assert d.failed == {}
    assert_landed(p, d, before, src, dst)


def test_cancel_mid_stream_answers_cancelled_and_frees_the_room(rig: Rig) -> None:
    p, streams = layer_mode(rig, seed=16)
    d = rig.make("decode")
    src, dst = [0, 1, 2], [3, 4, 5]
    d.mgr.add_recvs([recv_job(rig, "d-req", 506, dst)])
    wait_for(lambda: p.room_state(506) is RoomState.AWAITING_PREFILL, what="P to hold D's request")
    step = object()
    chunks = [chunk(506, src, 0, 3, final=True)]
    streams.on_layer(chunks, step, streams._layers[0])
    wait_for(lambda: streams._readers, what="a reader")
    assert d.mgr.decode is not None
    d.mgr.decode.cancel({"d-req"})  # vLLM aborted the request while its KV loaded
    d.wait_recv("d-req")
    assert "d-req" in d.failed
    wait_for(lambda: not streams._readers, what="the reader to end")
    for name in streams._layers[1:]:
        streams.on_layer(chunks, step, name)
    streams.on_forward_end(chunks, step)
    finish_prefill(p, 506, src)  # freed at once: the only claim was cancelled
    assert p.idle() and d.idle()


def test_aborted_prefill_stops_its_stream(rig: Rig) -> None:
    p, streams = layer_mode(rig, seed=17)
    d = rig.make("decode")
    src, dst = [0, 1], [3, 4]
    d.mgr.add_recvs([recv_job(rig, "d-req", 507, dst)])
    wait_for(lambda: p.room_state(507) is RoomState.AWAITING_PREFILL, what="P to hold D's request")
    run_step(streams, [chunk(507, src, 0, 1, final=False)], layers=1)
    p.mgr.drop_rooms([507])
    d.wait_recv("d-req")
    assert "d-req" in d.failed and not streams._readers and 507 not in streams._streams
    assert p.idle() and d.idle()


def test_write_failure_is_reported_once(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    from pd_connector.transfer.backend import TransferError

    p, streams = layer_mode(rig, seed=18)
    d = rig.make("decode")
    calls = threading.Event()

    def broken(*args: object, **kwargs: object) -> None:
        calls.set()
        raise TransferError("link down")

    monkeypatch.setattr(streams._backend, "write", broken)
    src, dst = [0, 1], [3, 4]
    d.mgr.add_recvs([recv_job(rig, "d-req", 508, dst)])
    wait_for(lambda: p.room_state(508) is RoomState.AWAITING_PREFILL, what="P to hold D's request")
    run_step(streams, [chunk(508, src, 0, 2, final=True)])
    d.wait_recv("d-req")
    assert calls.is_set() and "d-req" in d.failed
    assert p.stats().transfers_failed == 1
    finish_prefill(p, 508, src)
    assert p.idle() and d.idle()


def test_unknown_stream_calls_are_ignored(rig: Rig) -> None:
    _, streams = layer_mode(rig, seed=19)
    run_step(streams, [])
    streams.on_layer([chunk(509, [0], 0, 1, final=True)], object(), "not.a.layer")
    assert not streams._streams
    assert streams.stop(509, "x@y", DoneStatus.CANCELLED, "gone") is False
    streams.abort(509)
    streams.release(509)
    assert not streams._streams and not streams._readers


def test_enable_layer_push_is_given_what_it_needs(rig: Rig) -> None:
    """The worker's entry: the prefill side, the rank's spec and whether a staging buffer reshuffles its KV."""
    p = rig.make("prefill", seed=12, transfer_mode="layer")
    prefill = p.mgr.prefill
    assert prefill is not None
    assert enable_layer_push(prefill, p.mgr.spec, True, p.kv, NUM_BLOCKS) is None  # nhd_reshuffle: request mode
    assert prefill.layers is None
    streams = enable_layer_push(prefill, p.mgr.spec, False, p.kv, NUM_BLOCKS)
    assert streams is not None and prefill.layers is streams
    assert streams._layers == list(p.kv)
