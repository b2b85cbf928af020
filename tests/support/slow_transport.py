"""A slow local transport for the write-after-free tests: every batch copy takes ``batch_s`` and is
recorded with the time it landed, so a test can show no byte lands in D's blocks after D handed them
back (tests/unit/test_timing_contract.py, tests/unit/test_lost_peer_wait.py).

``register_slow_backend`` makes it a transfer backend by name, declaring ``stall_s`` as its bound on
one batch (``batch_stall_s``, what the timing contract derives D's waits from).
"""

from __future__ import annotations

import ctypes
import threading
import time

from pd_connector.config import DisaggConfig
from pd_connector.transfer.device_copy import DeviceCopyBackend
from pd_connector.transfer.registry import register_backend
from pd_connector.transfer_backends import NoOptions


class Landings:
    """Every entry the slow transport copied: (when it landed, D address, length); ``gate`` holds each batch."""

    def __init__(self, batch_s: float) -> None:
        self.batch_s = batch_s
        self.at: list[tuple[float, int, int]] = []
        self.started = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def reset(self) -> Landings:
        self.at.clear()
        self.started.clear()
        self.gate.set()
        return self

    def copy(self, dst: int, src: int, length: int) -> None:
        self.started.set()
        self.gate.wait(30)
        time.sleep(self.batch_s)  # one entry per batch (max_batch_entries 1): the batch takes this long
        ctypes.memmove(dst, src, length)
        self.at.append((time.monotonic(), dst, length))


def register_slow_backend(name: str, stall_s: float, landings: Landings) -> None:
    """Backend ``name``: local copies through ``landings``, declaring ``stall_s`` as its batch bound."""

    def open_backend(cfg: DisaggConfig) -> DeviceCopyBackend:
        return DeviceCopyBackend(copy=landings.copy, stall_s=cfg.backend_options.batch_stall_s)

    register_backend(name, open_backend, parse=lambda raw: NoOptions(batch_stall_s=stall_s))
