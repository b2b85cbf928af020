"""A simulated asynchronous accelerator for the unit tests, behind ``pd_connector.transfer.device_sync.DeviceSync``.

CPU kernels are synchronous, so no CPU test can see a transfer read KV before the device wrote
it. ``SimDevice`` brings back what an NPU/GPU does: ``write_blocks`` queues a KV write on the device's one
stream and returns at once; a device thread applies the queued writes in order, only while the
device runs (``pause`` / ``resume``) and each after ``latency_s``. ``record`` gives an event that
completes when every write queued before it landed, ``synchronize`` waits for all of them.

Each thread has a "current device" (``current_device``, 0 until ``bind_thread``), as with CUDA /
torch.npu; every event wait and synchronisation is noted with the waiting thread's current device
(``touches``), so a test can tell that a rank's transfer threads bound the rank's device.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pd_connector.transfer.device_sync import Marker

_local = threading.local()


def current_device() -> int:
    """The calling thread's current simulated device (0 until it binds one)."""
    return getattr(_local, "device", 0)


@dataclass(frozen=True)
class Touch:
    """A device call from a thread: what it was, the thread's name and its current device."""

    what: str
    thread: str
    device: int


class SimEvent:
    """Completes once the device applied every write queued before it was recorded."""

    def __init__(self, device: SimDevice, seq: int) -> None:
        self._device = device
        self._seq = seq

    def wait(self) -> None:
        self._device._note("event_wait")
        self._device._wait_for(self._seq)

    @property
    def done(self) -> bool:
        return self._device.landed >= self._seq


class SimDevice:
    """One rank's simulated accelerator (device ``index``): one stream, a device thread, events."""

    def __init__(self, index: int = 0, latency_s: float = 0.002, running: bool = True) -> None:
        self.index = index
        self.latency_s = latency_s
        self.touches: list[Touch] = []
        self.landed = 0  # writes applied so far
        self._queued = 0
        self._kernels: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._running = threading.Event()
        if running:
            self._running.set()
        self._thread = threading.Thread(target=self._run, name=f"sim-device-{index}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------- the "forward"

    def write_blocks(self, kv: torch.Tensor, blocks: list[int], values: torch.Tensor) -> None:
        """Queue ``kv[blocks] = values`` (values taken now) and return before it ran, as a device kernel does."""
        idx, value = torch.tensor(blocks, dtype=torch.long), values.clone()
        self.launch(lambda: kv.index_copy_(0, idx, value))

    def launch(self, kernel: Callable[[], None]) -> None:
        with self._cond:
            self._queued += 1
        self._kernels.put(kernel)

    def pause(self) -> None:
        """Queued writes wait (the device is busy elsewhere) until ``resume``."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def close(self) -> None:
        self._running.set()
        self._kernels.put(None)
        self._thread.join(timeout=5)

    # ------------------------------------------------------ DeviceSync protocol

    @property
    def name(self) -> str:
        return f"sim:{self.index}"

    def record(self) -> Marker:
        with self._cond:
            return SimEvent(self, self._queued)

    def bind_thread(self) -> None:
        _local.device = self.index
        self._note("bind")

    def synchronize(self, tensor: torch.Tensor) -> None:
        self._note("synchronize")
        with self._cond:
            seq = self._queued
        self._wait_for(seq)

    # ----------------------------------------------------------------- inside

    @property
    def pending(self) -> int:
        """Writes queued but not applied yet."""
        with self._cond:
            return self._queued - self.landed

    def bound_threads(self) -> set[str]:
        return {t.thread for t in self.touches if t.what == "bind"}

    def _note(self, what: str) -> None:
        self.touches.append(Touch(what, threading.current_thread().name, current_device()))

    def _wait_for(self, seq: int, timeout: float = 30.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.landed >= seq, timeout):
                raise TimeoutError(f"{self.name}: write {seq} did not land within {timeout} s")

    def _run(self) -> None:
        while True:
            kernel = self._kernels.get()
            if kernel is None:
                return
            self._running.wait()
            time.sleep(self.latency_s)
            kernel()
            with self._cond:
                self.landed += 1
                self._cond.notify_all()
