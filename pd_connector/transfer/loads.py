"""A D rank's KV load (``Load``) and how long a stopped load keeps its blocks (``stop_wait_s``).

No write after free: vLLM reuses a request's blocks as soon as D reports the request finished
(``finished_recving``, failed or not). A load that fails (a P rank's error, kv_wait_timeout_s, a lost
P rank) or is cancelled (vLLM aborted the request) after its P ranks were asked may still have
writes in flight: each P rank checks between every batch whether the reader still wants the bytes
(``backend.write_in_batches``), so at most its batch in flight lands, and it answers (``TransferDone``,
any status) once its write returned. D therefore tells each P rank that has not answered to stop
(``TransferCancel``) and keeps the load, state CANCELLING, until every P rank asked answered or was
declared lost (silent for peer_timeout_s, ``liveness``), or until ``stop_wait_s``, a bound longer
than P's slowest batch; only then does vLLM get the request (as failed) and its blocks back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pd_connector import messages as proto
from pd_connector.config import DisaggConfig
from pd_connector.metadata import RecvJob
from pd_connector.tp_mapping import HeadSlice
from pd_connector.transfer.backend import BATCH_STALL_S, WRITE_RETRIES
from pd_connector.transfer.states import LoadState
from pd_connector.transfer.stats import FailureReason

#: The shortest wait for P's last answers after a cancel (P answers within a batch: milliseconds).
CANCEL_GRACE_S = 2.0


def stop_wait_s(cfg: DisaggConfig) -> float:
    """How long a failed or cancelled load keeps its blocks out of reuse while a P rank it asked has
    not confirmed it stopped writing: P's slowest batch (``(1 + WRITE_RETRIES) * BATCH_STALL_S``, 20 s:
    a batch that makes no progress for BATCH_STALL_S fails, and P starts no batch after D's cancel)
    plus peer_timeout_s for the cancel to reach P and its answer to come back (25 s by default)."""
    return max(CANCEL_GRACE_S, (1 + WRITE_RETRIES) * BATCH_STALL_S + cfg.peer_timeout_s)


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
