"""TransferStats: the transfer manager's counters and observations, safe to bump from any thread.

Two views of the same events:

- ``snapshot()``: cumulative counters since the manager started (tests, logs);
- ``take_interval()``: what happened since the previous call, as the plain dict that
  ``pd_connector.metrics.PDKVConnectorStats`` carries through vLLM's stats path to the
  frontend's ``/metrics`` and its periodic log line (vLLM calls ``get_kv_connector_stats``
  once per engine step). The gauges (rooms held on P, loads waiting on D) are sampled by the
  caller and go out only when they changed.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

from pd_connector.messages import DoneStatus

StatName = Literal[
    "transfers_ok",
    "transfers_failed",
    "bytes_sent",
    "entries_sent",
    "bytes_received",
    "recvs_ok",
    "recvs_failed",
    "rooms_expired",
    "bad_frames",
    "rooms_refused",
    "auth_refused",
    "host_hit_blocks",
    "host_loads",
    "host_load_bytes",
]

#: Why a transfer or a load failed: the ``reason`` label of ``vllm:pd_kv_transfer_failures``.
FailureReason = Literal["timeout", "peer_lost", "mismatch", "aborted", "protocol_error"]
FAILURE_REASONS: tuple[str, ...] = get_args(FailureReason)

_REASON_OF_STATUS: dict[DoneStatus, FailureReason] = {
    DoneStatus.UNKNOWN_PEER: "peer_lost",
    DoneStatus.INCOMPATIBLE: "mismatch",
    DoneStatus.ROOM_CLOSED: "aborted",
    DoneStatus.ALREADY_SERVED: "protocol_error",
    DoneStatus.TIMEOUT: "timeout",
    DoneStatus.TRANSFER_FAILED: "peer_lost",
    DoneStatus.ABORTED: "aborted",
    DoneStatus.BAD_REQUEST: "protocol_error",
    DoneStatus.INTERNAL_ERROR: "protocol_error",
    DoneStatus.CANCELLED: "aborted",
    DoneStatus.PEER_LOST: "peer_lost",
}


def reason_of_status(status: DoneStatus) -> FailureReason:
    """The failure reason a non-OK ``TransferDone`` status counts as."""
    return _REASON_OF_STATUS.get(status, "protocol_error")


#: Keys of the interval dict whose values are lists of observations (one per transfer).
SERIES = ("transfer_seconds", "transfer_bytes", "transfer_entries", "handshake_seconds", "host_load_seconds")
#: Keys of the interval dict whose values are counts. A refused or malformed ZMQ frame
#: (``auth_refused``, ``bad_frames``) fails no transfer or load by itself, so it is counted
#: here and never as a ``failures`` reason: what it breaks shows up as that request's failure.
COUNTS = (
    "bytes_sent",
    "bytes_received",
    "transfers_ok",
    "recvs_ok",
    "rooms_expired",
    "auth_refused",
    "bad_frames",
    "host_hit_blocks",
    "host_loads",
    "host_load_bytes",
)
#: Keys of the interval dict's "gauges" dict (each: {rank id: value}).
GAUGES = ("rooms_held", "loads_waiting")


def empty_interval() -> dict[str, Any]:
    """The interval dict with nothing in it (every key present)."""
    data: dict[str, Any] = {key: [] for key in SERIES}
    data.update(dict.fromkeys(COUNTS, 0))
    data["failures"] = dict.fromkeys(FAILURE_REASONS, 0)
    data["gauges"] = {name: {} for name in GAUGES}
    return data


@dataclass(frozen=True)
class StatsSnapshot:
    """The counters at one moment (all taken under one lock)."""

    transfers_ok: int = 0  # P: pushes that landed (or needed no bytes)
    transfers_failed: int = 0  # P: pushes that failed (D was told)
    bytes_sent: int = 0
    entries_sent: int = 0  # P: (src, dst, length) entries handed to the backend
    bytes_received: int = 0  # D: bytes of this rank's blocks filled by completed loads
    recvs_ok: int = 0  # D: loads that completed
    recvs_failed: int = 0  # D: loads that failed (error, timeout)
    rooms_expired: int = 0  # P: rooms freed because no D asked in time
    bad_frames: int = 0  # ZMQ frames that were not PDConnector messages
    rooms_refused: int = 0  # P: prefills refused because their room was in use (KV freed at once)
    auth_refused: int = 0  # ZMQ frames refused: missing or wrong token (pd_connector.auth)
    host_hit_blocks: int = 0  # D2RH: blocks loaded from the host pool without asking P (pd_connector.d2rh.scheduler)
    host_loads: int = 0  # D2RH: host -> device copies done
    host_load_bytes: int = 0  # D2RH: bytes copied host -> device (staged bytes: bytes_received)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


NAMES: tuple[str, ...] = get_args(StatName)
assert set(NAMES) == set(StatsSnapshot.__dataclass_fields__)


class TransferStats:
    def __init__(self, rank_id: str = "0") -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(NAMES, 0)
        self._rank_id = rank_id
        self._interval = empty_interval()
        self._dirty = False
        self._last_gauges: dict[str, int] = {}

    def inc(self, name: StatName, n: int = 1) -> None:
        if name not in self._counts:
            raise KeyError(f"unknown transfer stat {name!r}; known: {list(NAMES)}")
        with self._lock:
            self._counts[name] += n
            if name in COUNTS:
                self._interval[name] += n
                self._dirty = True

    def observe_push(self, nbytes: int, entries: int, seconds: float) -> None:
        """P: one successful push of ``nbytes`` in ``entries`` entries that took ``seconds``."""
        with self._lock:
            self._counts["transfers_ok"] += 1
            self._counts["bytes_sent"] += nbytes
            self._counts["entries_sent"] += entries
            iv = self._interval
            iv["transfers_ok"] += 1
            iv["bytes_sent"] += nbytes
            iv["transfer_seconds"].append(seconds)
            iv["transfer_bytes"].append(nbytes)
            iv["transfer_entries"].append(entries)
            self._dirty = True

    def observe_recv(self, nbytes: int, handshake_s: float | None) -> None:
        """D: one completed load that filled ``nbytes`` of this rank's KV; its handshake time."""
        with self._lock:
            self._counts["recvs_ok"] += 1
            self._counts["bytes_received"] += nbytes
            iv = self._interval
            iv["recvs_ok"] += 1
            iv["bytes_received"] += nbytes
            if handshake_s is not None:
                iv["handshake_seconds"].append(handshake_s)
            self._dirty = True

    def observe_host_load(self, nbytes: int, hit_blocks: int, seconds: float) -> None:
        """D2RH: one host -> device copy of ``nbytes`` (``hit_blocks`` of its blocks were host-pool hits)."""
        with self._lock:
            for name, n in (("host_loads", 1), ("host_load_bytes", nbytes), ("host_hit_blocks", hit_blocks)):
                self._counts[name] += n
                self._interval[name] += n
            self._interval["host_load_seconds"].append(seconds)
            self._dirty = True

    def fail(self, reason: FailureReason, counter: StatName | None = None) -> None:
        """One failed transfer or load, by reason; also bumps ``counter`` (e.g. recvs_failed)."""
        if reason not in FAILURE_REASONS:
            raise KeyError(f"unknown failure reason {reason!r}; known: {list(FAILURE_REASONS)}")
        with self._lock:
            if counter is not None:
                self._counts[counter] += 1
            self._interval["failures"][reason] += 1
            self._dirty = True

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            return StatsSnapshot(**self._counts)

    def take_interval(self, gauges: dict[str, int] | None = None) -> dict[str, Any] | None:
        """Everything since the previous call (and the gauges if they changed); None if nothing."""
        with self._lock:
            changed = {k: v for k, v in (gauges or {}).items() if self._last_gauges.get(k) != v}
            if not self._dirty and not changed:
                return None
            data, self._interval, self._dirty = self._interval, empty_interval(), False
            self._last_gauges.update(changed)
        for name, value in changed.items():
            data["gauges"][name][self._rank_id] = value
        return data
