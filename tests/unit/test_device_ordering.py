"""Device ordering: no byte leaves P before the (asynchronous) device wrote it.

The forward runs on a simulated asynchronous device (tests/support/sim_device.py): its KV writes are
queued and land only once the device runs (it is paused while the hooks are called). P and D are
real KVTransferManagers (ZMQ, bootstrap, the in-process backend) as in test_layerwise /
test_transfer_manager. With the rank's device seam (``device_sync``) D gets the forward's KV byte
for byte, and nothing reaches D while the device is still busy; with the old ordering (the no-op
CPU seam, ``NO_DEVICE``, which is what P did before) D gets the bytes that were in P's blocks
*before* the forward: stale KV, no error anywhere. Both are asserted, so CI shows the failure mode
and its fix. The P ranks use device 1: their transfer threads must bind it (not device 0).
Mixed TP on token-major KV: test_device_ordering_nhd.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from pd_connector.metadata import SendJob
from pd_connector.scheduling.layer_chunks import LayerChunk
from pd_connector.transfer.device_sync import DONE, NO_DEVICE, DeviceSync, TorchDeviceSync, for_device
from pd_connector.transfer.layerwise import LayerStreams, layer_regions_of
from pd_connector.transfer.states import RoomState
from tests.support.loopback import wait_for
from tests.support.sim_device import SimDevice
from tests.support.transfer_rig import BLOCK_SIZE, LAYERS, Rig, Side, recv_job, snapshot

BUSY_S = 0.3  # how long the test keeps the device busy before it lets the forward's writes land
MODES = ["layer", "request"]


@pytest.fixture
def sim() -> Iterator[SimDevice]:
    """P's device: index 1 (a TP rank other than 0), paused until the test lets it run."""
    device = SimDevice(index=1, running=False)
    try:
        yield device
    finally:
        device.close()


def int16(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def fresh_kv(p: Side, src: list[int], seed: int) -> dict[str, torch.Tensor]:
    """What the forward writes into P's blocks ``src``: values P's blocks do not hold yet."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randint(3000, 6000, t[src].shape, generator=g).to(t.dtype) for name, t in p.kv.items()}


def run_forward(mode: str, sim: SimDevice, p: Side, streams: LayerStreams | None, room: int, src: list[int],
                fresh: dict[str, torch.Tensor]) -> None:  # fmt: skip
    """P's forward on the device: each layer's KV write is queued, then the hook comes at once."""
    if mode == "layer":
        assert streams is not None
        step, chunks = object(), [LayerChunk("p-req", room, tuple(src), 0, len(src), True)]
        for name in streams._layers:
            sim.write_blocks(p.kv[name], src, fresh[name])
            streams.on_layer(chunks, step, name)  # vLLM's save_kv_layer
        streams.on_forward_end(chunks, step)  # vLLM's wait_for_save
        return
    for name in p.kv:
        sim.write_blocks(p.kv[name], src, fresh[name])
    p.mgr.add_sends([SendJob("p-req", room, src, BLOCK_SIZE * len(src))])  # the next step's start_load_kv


def push_through_busy_device(
    rig: Rig, sim: SimDevice, mode: str, ordered: bool, room: int, seed: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor], Side, Side]:
    """(what D got, what P held before the forward, what the forward wrote, P, D)."""
    device: DeviceSync = sim if ordered else NO_DEVICE
    p = rig.make("prefill", seed=seed, transfer_mode=mode, device=device)
    streams = None
    if mode == "layer":
        assert p.mgr.prefill is not None
        streams = p.mgr.prefill.enable_layer_push(layer_regions_of(p.kv, [1] * LAYERS))
    d = rig.make("decode")
    before = snapshot(d.kv)
    src, dst = [0, 1, 2, 9], [5, 6, 11, 3]
    old = {name: t[src].clone() for name, t in p.kv.items()}
    fresh = fresh_kv(p, src, seed + 1)
    d.mgr.add_recvs([recv_job(rig, "d-req", room, dst)])
    wait_for(lambda: p.room_state(room) is RoomState.AWAITING_PREFILL, what="P to hold D's request")
    run_forward(mode, sim, p, streams, room, src, fresh)
    if ordered:
        time.sleep(BUSY_S)
        d.poll()
        assert "d-req" not in d.recving, "KV reached D while P's device had not written it"
        assert sim.pending == LAYERS
        sim.resume()
    d.wait_recv("d-req")
    got = {name: t[dst].clone() for name, t in d.kv.items()}
    sim.resume()  # the no-op seam: the forward lands only now
    sim.synchronize(next(iter(p.kv.values())))
    for name, t in p.kv.items():
        assert torch.equal(int16(t[src]), int16(fresh[name])), "the forward did write P's blocks"
        others = [b for b in range(t.shape[0]) if b not in dst]
        assert torch.equal(int16(d.kv[name][others]), int16(before[name][others])), name
    if mode == "layer":  # P's scheduler saw the prefill finish: the room is freed (request mode: sent already)
        p.mgr.add_sends([SendJob("p-req", room, src, BLOCK_SIZE * len(src))])
    p.wait_sent("p-req")
    assert d.failed == {}
    return got, old, fresh, p, d


@pytest.mark.parametrize("mode", MODES)
def test_the_device_seam_makes_d_byte_exact(rig: Rig, sim: SimDevice, mode: str) -> None:
    got, _, fresh, p, _ = push_through_busy_device(rig, sim, mode, ordered=True, room=700 + len(mode), seed=31)
    for name in got:
        assert torch.equal(int16(got[name]), int16(fresh[name])), name
    # P's transfer threads bound P's device (1), and every event wait ran on such a thread.
    waits = [t for t in sim.touches if t.what == "event_wait"]
    assert waits and all(t.device == sim.index for t in waits), sim.touches
    thread = "pd-layer-push" if mode == "layer" else "pd-xfer"
    assert any(t.thread.startswith(thread) for t in waits), waits
    assert {t.thread for t in waits} <= sim.bound_threads()
    assert p.stats().transfers_ok == 1


@pytest.mark.parametrize("mode", MODES)
def test_without_the_device_seam_d_gets_stale_kv(rig: Rig, sim: SimDevice, mode: str) -> None:
    """The old ordering (nothing waits for the device): D silently gets what P held before the forward."""
    got, old, fresh, p, _ = push_through_busy_device(rig, sim, mode, ordered=False, room=710 + len(mode), seed=41)
    for name in got:
        assert torch.equal(int16(got[name]), int16(old[name])), name
        assert not torch.equal(int16(got[name]), int16(fresh[name])), name
    assert p.stats().transfers_ok == 1  # and every side reports success


# ------------------------------------------------------------------ the seam itself


class FakeAccelerator:
    """torch.<backend>'s Event / current_stream / set_device / synchronize, recording what is called."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        outer = self

        class Stream:
            def __init__(self, device: torch.device) -> None:
                self.device = device

            def synchronize(self) -> None:
                outer.calls.append(("stream_sync", self.device))

        class Event:
            def record(self, stream: Stream) -> None:
                outer.calls.append(("record", stream.device))

            def synchronize(self) -> None:
                outer.calls.append(("event_sync", None))

        self.Event, self._stream = Event, Stream

    def current_stream(self, device: torch.device) -> object:
        return self._stream(device)

    def set_device(self, device: torch.device) -> None:
        self.calls.append(("set_device", device))

    def synchronize(self, device: torch.device | None = None) -> None:
        self.calls.append(("device_sync", device))

    def current_device(self) -> int:
        return 0


def test_torch_device_sync_names_the_ranks_and_the_tensors_device(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeAccelerator()
    monkeypatch.setattr(torch, "xpu", fake)
    sync = for_device(torch.device("xpu", 3))
    assert isinstance(sync, TorchDeviceSync) and sync.name == "xpu:3"
    sync.bind_thread()
    marker = sync.record()
    marker.wait()
    sync.synchronize(SimpleNamespace(device=torch.device("xpu", 3)))  # type: ignore[arg-type]
    sync.synchronize(torch.zeros(1))  # a CPU tensor: nothing to wait for
    rank = torch.device("xpu", 3)
    assert fake.calls == [("set_device", rank), ("record", rank), ("event_sync", None), ("stream_sync", rank)]
    assert not any(call[0] == "device_sync" for call in fake.calls), "never the default device's sync"


def test_cpu_needs_no_ordering_and_unknown_devices_are_named() -> None:
    assert for_device(torch.device("cpu")) is NO_DEVICE
    assert NO_DEVICE.record() is DONE
    DONE.wait()
    NO_DEVICE.bind_thread()
    with pytest.raises(ValueError, match="'meta'"):
        for_device(torch.device("meta"))


def test_nhd_synchronize_goes_through_the_ranks_seam() -> None:
    from pd_connector.transfer.nhd_reshuffle import _synchronize

    device = SimDevice(index=2)
    try:
        t = torch.zeros(4)
        device.write_blocks(t, [0], torch.ones(1))
        _synchronize(t, device)
        assert t[0] == 1 and device.touches[-1].what == "synchronize"
        _synchronize(t, None)  # CPU tensor, no seam: nothing to wait for
    finally:
        device.close()
