"""A D rank's KV load (``Load``) and how long a stopped load keeps its blocks (``stop_wait_s``).

No write after free: vLLM reuses a request's blocks as soon as D reports the request finished
(``finished_recving``, failed or not). A load that fails (a P rank's error, kv_wait_timeout_s, a lost
P rank) or is cancelled (vLLM aborted the request) after its P ranks were asked may still have
writes in flight: each P rank checks between every batch whether the reader still wants the bytes
(``backend.write_in_batches``), so at most its batch in flight lands, and it answers (``TransferDone``,
any status) once its write returned. D therefore tells each P rank that has not answered to stop
(``TransferCancel``) and keeps the load, state CANCELLING, until every P rank asked answered or was
declared lost (silent for peer_timeout_s, ``liveness``), or until ``stop_wait_s``.

The timing contract, from the active transport's bound on one batch write (``batch_stall_s`` of the
backend's options: ``transfer_backends.BackendOptions``):

- P: a batch starts only while the reader wants it, and a batch with its retries ends within
  ``batch_budget_s(batch_stall_s)`` = ``(1 + WRITE_RETRIES) * batch_stall_s`` of its start
  (``write_in_batches`` starts no retry that could end later).
- P learns that D gave up within peer_timeout_s: D's TransferCancel, or P's liveness declares a D
  rank lost after peer_timeout_s of silence and stops its writes the same way.
- D: so every byte of a stopped load has landed ``batch_budget_s + peer_timeout_s`` after D gave up;
  ``stop_wait_s`` adds ``STOP_MARGIN_S`` (listener ticks, thread scheduling, a transport ending a
  batch a moment after its timeout).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pd_connector import messages as proto
from pd_connector.config import DisaggConfig
from pd_connector.metadata import RecvJob
from pd_connector.tp_mapping import HeadSlice
from pd_connector.transfer.backend import batch_budget_s
from pd_connector.transfer.states import LoadState
from pd_connector.transfer.stats import FailureReason

#: What D's stop wait adds to the in-flight bound P keeps: the listener's ticks (liveness, expiry),
#: thread scheduling, a transport returning a moment after its timeout (``backend.overrun_tolerance_s``).
STOP_MARGIN_S = 2.0


def in_flight_s(cfg: DisaggConfig) -> float:
    """How long one batch of P's, its retries included, may still be landing once it started:
    ``(1 + WRITE_RETRIES) * batch_stall_s`` of the active backend's options."""
    return batch_budget_s(cfg.backend_options.batch_stall_s)


def stop_wait_s(cfg: DisaggConfig) -> float:
    """How long a failed or cancelled load keeps its blocks out of reuse while a P rank it asked has
    not confirmed it stopped writing: P's slowest batch (``in_flight_s``) plus peer_timeout_s (for the
    cancel, or P's liveness, to stop P) plus ``STOP_MARGIN_S``. Mooncake TCP by default:
    2 * 30 + 5 + 2 = 67 s; HIXL with ASCEND_TRANSFER_TIMEOUT=120000: 2 * 120 + 5 + 2 = 247 s."""
    return in_flight_s(cfg) + cfg.peer_timeout_s + STOP_MARGIN_S


def lost_wait_s(cfg: DisaggConfig) -> float:
    """How long after D declared a P rank lost (silent for peer_timeout_s) a batch of it may still be
    landing: a P rank that is alive but cut off stops starting batches within peer_timeout_s of D's
    last word (its own liveness) and ends the batch in flight within ``in_flight_s``."""
    return in_flight_s(cfg) + STOP_MARGIN_S


@dataclass
class Load:
    job: RecvJob
    deadline: float
    state: LoadState = LoadState.RESOLVING
    endpoints: list[str] = field(default_factory=list)  # P ranks asked (AWAITING_KV)
    rank_at: dict[str, int] = field(default_factory=dict)  # endpoint asked -> its P rank number (below)
    done: set[int] = field(default_factory=set)  # P ranks (pp * P's TP size + tp) that reported OK
    p_tp: int = 1  # P's TP size: a P rank's number above is pp * p_tp + tp
    started: float = field(default_factory=time.monotonic)
    handshake_s: float | None = None  # from add_recvs to the request sent to every P rank
    cancelled: bool = False  # vLLM aborted the request (RESOLVING: cancel once P's ranks are known)
    answered: set[int] = field(default_factory=set)  # CANCELLING: P ranks that answered (stopped) or were lost
    failure: tuple[str, FailureReason] | None = None  # CANCELLING after a failure: what vLLM is told at release
    slices: list[HeadSlice] = field(default_factory=list)  # token-major KV: the plan to reformat by
    reports: dict[int, tuple[int, int | None]] = field(default_factory=dict)  # P rank -> (bytes, checksum)

    def p_rank(self, done: proto.TransferDone) -> int:  # TP rank after every earlier pipeline stage's
        return done.pp_rank * self.p_tp + done.tp_rank

    @property
    def complete(self) -> bool:
        return self.state is LoadState.AWAITING_KV and len(self.done) >= len(self.endpoints) > 0

    @property
    def stopped(self) -> bool:
        """CANCELLING: every P rank asked answered or was lost (no write of it is in flight)."""
        return len(self.answered | self.done) >= len(self.endpoints)
