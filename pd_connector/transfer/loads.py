"""A D rank's KV load (``Load``) and how long a stopped load keeps its blocks (``stop_wait_s``).

No write after free: vLLM reuses a request's blocks as soon as D reports the request finished
(``finished_recving``, failed or not). A load that fails (a P rank's error, kv_wait_timeout_s, a lost
P rank) or is cancelled (vLLM aborted the request) after its P ranks were asked may still have
writes in flight: each P rank checks between every batch whether the reader still wants the bytes
(``backend.write_in_batches``), so at most its batch in flight lands, and it answers (``TransferDone``,
any status) once its write returned. D therefore tells each P rank that has not answered to stop
(``TransferCancel``, a lost one too) and keeps the load, state CANCELLING, until every P rank asked
answered, or until its wait (``stop_wait_s``; ``lost_wait_s`` after a loss) ran out.

The timing contract, from the P ranks' own bound on one batch write (``batch_stall_s`` of their
backend's options, ``transfer.registry.BackendOptions``) and their ``peer_timeout_s``: each P rank
advertises both when it registers (``RegisterRank``; D reads them in the route's ``RankInfo``), and a
load uses the largest among the P ranks it asked (``PeerTiming``; a rank that advertised nothing, from
an older release, counts with D's own values):

- P: a batch starts only while the reader wants it, and a batch with its retries ends within
  ``batch_budget_s(batch_stall_s)`` = ``(1 + WRITE_RETRIES) * batch_stall_s`` of its start
  (``write_in_batches`` starts no retry that could end later).
- P learns that D gave up within its peer_timeout_s: D's TransferCancel, or P's liveness declares the D
  rank lost after peer_timeout_s of silence and stops its writes the same way.
- D: so every byte of a stopped load has landed ``batch_budget_s + peer_timeout_s`` after D gave up;
  ``stop_wait_s`` adds ``STOP_MARGIN_S`` (listener ticks, thread scheduling, a transport ending a
  batch a moment after its timeout).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pd_connector import messages as proto
from pd_connector.config import DisaggConfig
from pd_connector.layouts.tp import HeadSlice
from pd_connector.metadata import RecvJob
from pd_connector.transfer.backend import batch_budget_s
from pd_connector.transfer.states import LoadState
from pd_connector.transfer.stats import FailureReason

#: What D's stop wait adds to the in-flight bound P keeps: the listener's ticks (liveness, expiry),
#: thread scheduling, a transport returning a moment after its timeout (``backend.overrun_tolerance_s``).
STOP_MARGIN_S = 2.0


@dataclass(frozen=True)
class PeerTiming:
    """What bounds the writes of the P ranks a load asked: the longest ``batch_stall_s`` of their
    transports and the longest ``peer_timeout_s`` of their liveness (seconds)."""

    batch_stall_s: float
    peer_timeout_s: float


def own_timing(cfg: DisaggConfig) -> PeerTiming:
    """This rank's own bounds: what a P rank that advertised none is assumed to run with."""
    return PeerTiming(cfg.backend_options.batch_stall_s, cfg.peer_timeout_s)


def _told(value: float, own: float) -> float:
    return value if math.isfinite(value) and value > 0 else own  # 0: not told (an older P rank)


def timing_of(cfg: DisaggConfig, ranks: Iterable[proto.RankInfo]) -> PeerTiming:
    """The bounds of a load that asked ``ranks``: the largest each P rank advertised, D's own for a
    rank that advertised none (``own_timing``)."""
    own = own_timing(cfg)
    told = [
        PeerTiming(_told(r.batch_stall_s, own.batch_stall_s), _told(r.peer_timeout_s, own.peer_timeout_s))
        for r in ranks
    ]
    if not told:
        return own
    return PeerTiming(max(t.batch_stall_s for t in told), max(t.peer_timeout_s for t in told))


def in_flight_s(cfg: DisaggConfig, timing: PeerTiming | None = None) -> float:
    """How long one batch of P's, its retries included, may still be landing once it started:
    ``(1 + WRITE_RETRIES) * batch_stall_s`` of the P ranks' transports (``timing``; None: D's own)."""
    return batch_budget_s((timing or own_timing(cfg)).batch_stall_s)


def stop_wait_s(cfg: DisaggConfig, timing: PeerTiming | None = None) -> float:
    """How long a failed or cancelled load keeps its blocks out of reuse while a P rank it asked has
    not confirmed it stopped writing: P's slowest batch (``in_flight_s``) plus P's peer_timeout_s (for
    the cancel, or P's liveness, to stop P) plus ``STOP_MARGIN_S``. ``timing``: the P ranks' bounds
    (``timing_of``; None: D's own). Mooncake TCP by default: 2 * 30 + 5 + 2 = 67 s; HIXL with
    ASCEND_TRANSFER_TIMEOUT=120000 on P: 2 * 120 + 5 + 2 = 247 s, whatever D's own transport."""
    timing = timing or own_timing(cfg)
    return in_flight_s(cfg, timing) + timing.peer_timeout_s + STOP_MARGIN_S


def lost_wait_s(cfg: DisaggConfig, timing: PeerTiming | None = None) -> float:
    """How long a load keeps its blocks after D declared a P rank it asked lost (no Pong or Ping from it
    for peer_timeout_s) and sent it a ``TransferCancel`` anyway: the same as ``stop_wait_s``.

    D's liveness sees only the P -> D direction; a lost P rank may be dead, or alive with its messages to
    D cut while its writes still land. Counting from the cancel D sends when it declares the loss (L):

    - P still hears D: the cancel reaches it at once; it starts no batch after it, and the batch in flight
      ends within ``in_flight_s``: all landed by L + ``in_flight_s``.
    - P does not hear D (D -> P cut too; the cancel is lost): P's liveness declares D lost
      peer_timeout_s after the last frame of D's it heard, and stops its writes the same way. That last
      frame may have come just before L (D pings P until it declares the loss; the cut may begin a moment
      before), so P may start batches until L + peer_timeout_s, and the last ends within ``in_flight_s``
      of its start: L + peer_timeout_s + ``in_flight_s``. Nothing says the write path fails with the
      control path (another network, another direction), so this case bounds the wait.

    Hence P's ``in_flight_s`` plus P's peer_timeout_s plus ``STOP_MARGIN_S`` from L, which is
    ``stop_wait_s``. A P rank that answers meanwhile (any ``TransferDone``: sent only once its write
    returned) ends the wait at once; a dead one costs the whole wait."""
    return stop_wait_s(cfg, timing)


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
    answered: set[int] = field(default_factory=set)  # CANCELLING: P ranks that answered (stopped writing)
    lost: set[int] = field(default_factory=set)  # P ranks declared lost: told to stop, not watched; may still write
    timing: PeerTiming | None = None  # the asked P ranks' bounds (timing_of); None: D's own
    wait_s: float = 0.0  # CANCELLING: the wait in force (stop_wait_s or lost_wait_s), for the log
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
        """CANCELLING: every P rank asked answered (no write of it is in flight). A lost rank has not: only
        its answer or the load's wait (``lost_wait_s``) ends it."""
        return len(self.answered | self.done) >= len(self.endpoints)
