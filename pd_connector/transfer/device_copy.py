"""``backend: device_copy``: P and D ranks in one process, KV written by a plain memory copy.

For tests and single-host runs without Mooncake. Every backend opened in this process gets a
descriptor (``device_copy:<pid>:<n>``) in a process-global table; ``write`` looks the peer up
there, refuses any entry whose source is not in this rank's registered ranges or whose
destination is not in the peer's, then copies: ``cudaMemcpy`` (kind default, so host or CUDA
memory either side) when a CUDA runtime with a device is loaded in this process, else
``ctypes.memmove`` (host memory). It has no option keys; NPU memory is refused at start-up.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_connector.transfer.backend import Ints, TransferError, Wanted, write_in_batches
from pd_connector.transfer.registry import LOCAL_COPY_STALL_S, BackendSpec

if TYPE_CHECKING:
    from pd_connector.config import DisaggConfig

logger = logging.getLogger(__name__)

_TABLE: dict[bytes, DeviceCopyBackend] = {}
_LOCK = threading.Lock()
_IDS = itertools.count(1)
_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)

Copy = Callable[[int, int, int], None]  # (dst, src, length)


def _host_copy(dst: int, src: int, length: int) -> None:
    ctypes.memmove(dst, src, length)


def _cuda_copy() -> Copy | None:
    """cudaMemcpy of the CUDA runtime already loaded in this process (by torch), None without a device."""
    for name in ("libcudart.so", "libcudart.so.12", "libcudart.so.13"):
        try:
            cudart = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError:
            continue
    else:
        return None
    count = ctypes.c_int(0)
    if cudart.cudaGetDeviceCount(ctypes.byref(count)) != 0 or count.value < 1:
        return None
    memcpy = cudart.cudaMemcpy
    memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def copy(dst: int, src: int, length: int) -> None:
        ret = memcpy(dst, src, length, _CUDA_MEMCPY_DEFAULT)
        if ret != 0:
            raise TransferError(f"cudaMemcpy of {length} bytes failed with {ret}")

    return copy


@dataclass(frozen=True)
class DeviceCopyOptions:
    """No keys; a batch is a loop of copies, so it is only bounded to keep a cancel prompt, and it ends
    within ``batch_stall_s`` (no peer or network to wait for)."""

    batch_limit: int = 1 << 16
    uses_hixl: bool = False
    batch_stall_s: float = LOCAL_COPY_STALL_S

    def memory_problem(self, device_types: Iterable[str], regions: int, staging: int) -> str | None:
        other = sorted(set(device_types) - {"cpu", "cuda"})
        if other:
            return f"the device_copy backend copies host or CUDA memory, not KV cache memory on device {other[0]!r}"
        return None

    def prepare_rank(self, local_rank: int) -> None:
        return None

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> DeviceCopyOptions:
        return cls()


def _inside(ranges: Sequence[tuple[int, int]], addr: int, length: int) -> bool:
    return any(base <= addr and addr + length <= base + size for base, size in ranges)


class DeviceCopyBackend:
    """One rank's registered ranges; ``write`` copies into another rank's of this process."""

    def __init__(self, copy: Copy | None = None, stall_s: float | None = None) -> None:
        """``stall_s``: the options' ``batch_stall_s`` (each batch's bound, ``write_in_batches``)."""
        self._copy = copy or _cuda_copy() or _host_copy
        self.stall_s = stall_s
        self._descriptor = f"device_copy:{os.getpid()}:{next(_IDS)}".encode()
        self._ranges: list[tuple[int, int]] = []
        self.batches = 0  # batch writes this backend made
        with _LOCK:
            _TABLE[self._descriptor] = self

    @classmethod
    def from_config(cls, cfg: DisaggConfig) -> DeviceCopyBackend:
        return cls(stall_s=cfg.backend_options.batch_stall_s)

    @property
    def descriptor(self) -> bytes:
        return self._descriptor

    def register(self, ranges: Sequence[tuple[int, int]]) -> None:
        self._ranges.extend(ranges)

    def write(
        self, peer_descriptor: bytes, src: Ints, dst: Ints, lengths: Ints, max_batch: int, still_wanted: Wanted = None
    ) -> None:
        with _LOCK:
            peer = _TABLE.get(peer_descriptor)
        if peer is None:
            raise TransferError(f"no device_copy backend {peer_descriptor!r} in this process (pid {os.getpid()})")

        def write_batch(s: list[int], d: list[int], n: list[int]) -> int:
            self.batches += 1
            entries = list(zip(s, d, n, strict=True))
            for s_addr, d_addr, length in entries:
                if not _inside(self._ranges, s_addr, length) or not _inside(peer._ranges, d_addr, length):
                    logger.warning(
                        "device_copy entry 0x%x -> 0x%x (%d bytes) is outside registered memory", s_addr, d_addr, length
                    )
                    return -1
            for s_addr, d_addr, length in entries:
                self._copy(d_addr, s_addr, length)
            return 0

        peer_name = peer_descriptor.decode()
        write_in_batches(
            write_batch,
            src,
            dst,
            lengths,
            max_batch,
            still_wanted,
            what="device_copy",
            peer=peer_name,
            stall_s=self.stall_s,
        )

    def close(self) -> None:
        with _LOCK:
            _TABLE.pop(self._descriptor, None)
        self._ranges.clear()


BACKEND = BackendSpec(open=DeviceCopyBackend.from_config, parse=DeviceCopyOptions.parse)
