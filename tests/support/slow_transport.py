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
from typing import Any

import pytest

from pd_connector.config import DisaggConfig
from pd_connector.metadata import SendJob
from pd_connector.transfer import loads
from pd_connector.transfer.device_copy import DeviceCopyBackend
from pd_connector.transfer.registry import NoOptions, register_backend
from tests.support.transfer_rig import BLOCK_SIZE, NUM_BLOCKS, Rig, Side, recv_job


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


def start_slow_push(
    rig: Rig,
    monkeypatch: pytest.MonkeyPatch,
    room: int,
    blocks: tuple[list[int], list[int]],
    peer_timeout_s: float,
    **decode_keys: Any,
) -> tuple[Side, Side, dict[str, float]]:
    """P pushes ``blocks[0]`` into D's ``blocks[1]`` one entry per batch over the slow transport.

    Returns P, D and D's hand-back times (request id -> when D reported the load to vLLM, failed or not).
    ``decode_keys``: D's extra config keys (e.g. a short kv_wait_timeout_s). The stop margin is 0.2 s here.
    """
    monkeypatch.setattr(loads, "STOP_MARGIN_S", 0.2)  # the margin at these tests' scale
    p = rig.make("prefill", max_batch_entries=1, peer_timeout_s=peer_timeout_s)
    d = rig.make("decode", peer_timeout_s=peer_timeout_s, **decode_keys)
    handed: dict[str, float] = {}
    inner = d.mgr.outbox.received

    def received(req_id: str, failed_blocks: list[int] | None = None) -> None:
        handed[req_id] = time.monotonic()
        inner(req_id, failed_blocks)

    monkeypatch.setattr(d.mgr.outbox, "received", received)
    p_blocks, d_blocks = blocks
    p.mgr.add_sends([SendJob("p-1", room, p_blocks, BLOCK_SIZE * len(p_blocks))])
    d.mgr.add_recvs([recv_job(rig, "d-1", room, d_blocks)])
    return p, d, handed


def late_landings(landings: Landings, d: Side, handed_back: float) -> list[tuple[float, int]]:
    """(seconds after the hand-back, D block) of every entry that landed in D's blocks after it."""
    out = []
    for t in d.kv.values():
        base, size = t.data_ptr(), t[0].numel() * t.element_size()
        for at, addr, _ in landings.at:
            if base <= addr < base + NUM_BLOCKS * size and at > handed_back:
                out.append((round(at - handed_back, 3), (addr - base) // size))
    return out
