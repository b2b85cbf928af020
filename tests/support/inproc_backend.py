"""An in-process TransferBackend for tests: ctypes.memmove between registered ranges of this process.

Each backend gets a unique descriptor in a process-global table; ``write`` looks the peer up
there and refuses any entry whose source is not in its own registered memory or whose
destination is not in the peer's. ``register_inproc()`` makes it the ``backend: "inproc"``.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence

from pd_connector.config import DisaggConfig
from pd_connector.transfer.backend import Ints, TransferError, Wanted, write_in_batches
from pd_connector.transfer.registry import register_backend

NAME = "inproc"

_TABLE: dict[bytes, InprocBackend] = {}
_TABLE_LOCK = threading.Lock()
_IDS = itertools.count(1)


def _inside(ranges: Sequence[tuple[int, int]], addr: int, length: int) -> bool:
    return any(base <= addr and addr + length <= base + size for base, size in ranges)


class InprocBackend:
    def __init__(self) -> None:
        self._descriptor = f"inproc-{next(_IDS)}".encode()
        self._ranges: list[tuple[int, int]] = []
        self.batches = 0  # batch writes this backend made
        with _TABLE_LOCK:
            _TABLE[self._descriptor] = self

    @property
    def descriptor(self) -> bytes:
        return self._descriptor

    def register(self, ranges: Sequence[tuple[int, int]]) -> None:
        self._ranges.extend(ranges)

    def write(
        self, peer_descriptor: bytes, src: Ints, dst: Ints, lengths: Ints, max_batch: int, still_wanted: Wanted = None
    ) -> None:
        with _TABLE_LOCK:
            peer = _TABLE.get(peer_descriptor)
        if peer is None:
            raise TransferError(f"no in-process backend {peer_descriptor!r}")

        def write_batch(s: list[int], d: list[int], n: list[int]) -> int:
            self.batches += 1
            for s_addr, d_addr, length in zip(s, d, n, strict=True):
                if not _inside(self._ranges, s_addr, length) or not _inside(peer._ranges, d_addr, length):
                    return -1
            for s_addr, d_addr, length in zip(s, d, n, strict=True):
                ctypes.memmove(d_addr, s_addr, length)
            return 0

        what = "in-process batch write"
        write_in_batches(
            write_batch, src, dst, lengths, max_batch, still_wanted, what=what, peer=peer_descriptor.decode()
        )

    def close(self) -> None:
        with _TABLE_LOCK:
            _TABLE.pop(self._descriptor, None)
        self._ranges.clear()


def _factory(cfg: DisaggConfig) -> InprocBackend:
    return InprocBackend()


def register_inproc() -> None:
    register_backend(NAME, _factory)
