"""The device seam: ordering KV bytes against an asynchronous accelerator (NPU, GPU), a no-op on CPU.

On an NPU or GPU a forward pass only *queues* kernels on a device stream: when vLLM calls
``save_kv_layer`` or ``wait_for_save`` the layer's KV write may not have run yet. Before a byte of
it leaves P (or, on D, before received blocks reach vLLM) the device must have done that work.
Everything PDConnector needs from the device goes through a ``DeviceSync`` chosen from the KV
tensors' device (``for_device``):

- ``record()``: on the calling thread (the forward's), a ``Marker`` on the current stream of the
  rank's device (an event queued behind the kernels already queued there);
- ``Marker.wait()``: block the calling thread (a transfer thread) until that event completed;
- ``bind_thread()``: make the rank's device current on the calling thread (every thread that
  touches device memory, events or streams; vLLM-Ascend's sender and receiver threads call
  ``torch.npu.set_device`` the same way): TP rank 3 must not synchronise, or create a context on, NPU 0;
- ``synchronize(tensor)``: wait for the work this thread queued on the *tensor's* device (its
  current stream there), never the default device's.

``TorchDeviceSync`` implements it with torch's per-backend modules (``torch.npu`` from torch_npu on
vLLM-Ascend: ``Event``, ``current_stream``, ``set_device``; ``torch.cuda`` the same), ``NO_DEVICE``
for CPU tensors (kernels there are synchronous). Tests plug a simulated asynchronous device behind
the same protocol (tests/support/sim_device.py).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, runtime_checkable

import torch

logger = logging.getLogger(__name__)


@runtime_checkable
class Marker(Protocol):
    """A point in a device stream: ``wait`` returns once the device did everything queued before it."""

    def wait(self) -> None: ...


@runtime_checkable
class DeviceSync(Protocol):
    """One rank's device, as the transfer code orders its work against it."""

    @property
    def name(self) -> str:
        """The device, for log lines ("npu:3", "cuda:0", "cpu")."""
        ...

    def record(self) -> Marker:
        """A marker on the calling thread's current stream of this device (call it on the forward's thread)."""
        ...

    def bind_thread(self) -> None:
        """Make this device current on the calling thread (thread pools call it at thread start)."""
        ...

    def synchronize(self, tensor: torch.Tensor) -> None:
        """Wait until the work this thread queued on ``tensor``'s device is done."""
        ...


class _Done:
    """A marker that is already complete (CPU: the work ran when it was called)."""

    def wait(self) -> None:
        return None


DONE: Marker = _Done()


class NoDevice:
    """CPU tensors: kernels are synchronous, so every marker is already complete."""

    name = "cpu"

    def record(self) -> Marker:
        return DONE

    def bind_thread(self) -> None:
        return None

    def synchronize(self, tensor: torch.Tensor) -> None:
        return None


NO_DEVICE = NoDevice()


class _EventMarker:
    def __init__(self, event: Any) -> None:
        self._event = event

    def wait(self) -> None:
        self._event.synchronize()


class TorchDeviceSync:
    """An accelerator through its torch module (``torch.npu``, ``torch.cuda``, ...): events and streams."""

    def __init__(self, device: torch.device) -> None:
        module = getattr(torch, device.type, None)
        missing = [n for n in ("Event", "current_stream", "set_device", "synchronize") if not hasattr(module, n)]
        if module is None or missing:
            raise ValueError(
                f"KV tensors on device type {device.type!r}: torch.{device.type} lacks {missing or 'everything'} "
                "(PDConnector orders transfers with the Event/current_stream/set_device API of torch.npu / torch.cuda)"
            )
        index = device.index if device.index is not None else module.current_device()
        self._module = module
        self.device = torch.device(device.type, index)

    @property
    def name(self) -> str:
        return str(self.device)

    def record(self) -> Marker:
        event = self._module.Event()
        event.record(self._module.current_stream(self.device))
        return _EventMarker(event)

    def bind_thread(self) -> None:
        self._module.set_device(self.device)

    def synchronize(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cpu":
            return
        self._module.current_stream(tensor.device).synchronize()


def for_device(device: torch.device) -> DeviceSync:
    """The seam for KV tensors on ``device``: ``NO_DEVICE`` on CPU, else the backend's events and streams."""
    if device.type == "cpu":
        return NO_DEVICE
    return TorchDeviceSync(device)


def for_kv_caches(kv_caches: dict[str, Any]) -> DeviceSync:
    """The seam for a rank's KV (the first tensor's device; vLLM keeps a rank's KV on one device)."""
    first = next(iter(kv_caches.values()), None)
    first = first[0] if isinstance(first, (list, tuple)) else first
    if not isinstance(first, torch.Tensor):
        return NO_DEVICE
    sync = for_device(first.device)
    logger.info("KV on %s: transfers wait for the device's events (pd_connector.transfer.device_sync)", sync.name)
    return sync


def synchronize_tensor(tensor: torch.Tensor, sync: DeviceSync | None = None) -> None:
    """Wait for this thread's queued work on ``tensor``'s device, through ``sync`` when given."""
    if sync is not None:
        sync.synchronize(tensor)
    elif tensor.device.type != "cpu":
        for_device(tensor.device).synchronize(tensor)
