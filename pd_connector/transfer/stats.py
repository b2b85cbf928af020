"""TransferStats: the transfer manager's counters, safe to bump from any thread."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Literal, get_args

StatName = Literal[
    "transfers_ok",
    "transfers_failed",
    "bytes_sent",
    "entries_sent",
    "recvs_ok",
    "recvs_failed",
    "rooms_expired",
    "bad_frames",
]


@dataclass(frozen=True)
class StatsSnapshot:
    """The counters at one moment (all taken under one lock)."""

    transfers_ok: int = 0  # P: pushes that landed (or needed no bytes)
    transfers_failed: int = 0  # P: pushes that failed (D was told)
    bytes_sent: int = 0
    entries_sent: int = 0  # P: (src, dst, length) entries handed to the backend
    recvs_ok: int = 0  # D: loads that completed
    recvs_failed: int = 0  # D: loads that failed (error, timeout)
    rooms_expired: int = 0  # P: rooms freed because no D asked in time
    bad_frames: int = 0  # ZMQ frames that were not PDConnector messages

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


NAMES: tuple[str, ...] = get_args(StatName)
assert set(NAMES) == set(StatsSnapshot.__dataclass_fields__)


class TransferStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(NAMES, 0)

    def inc(self, name: StatName, n: int = 1) -> None:
        if name not in self._counts:
            raise KeyError(f"unknown transfer stat {name!r}; known: {list(NAMES)}")
        with self._lock:
            self._counts[name] += n

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            return StatsSnapshot(**self._counts)
