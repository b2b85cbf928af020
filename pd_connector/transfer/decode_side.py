"""DecodeSide: a D rank's KV loads.

Each `RecvJob` resolves the P ranks to ask (``prefill_ranks``: bootstrap route, cached, with what
bounds each rank's writes), sends `PeerHello` once per P rank and a `TransferRequest` per request,
then waits for `TransferDone` from every P rank it asked. Errors, a lost P rank and kv_wait_timeout_s
end the load as failed; vLLM then recomputes or fails the request, but only once no P rank asked can
still write into its blocks (``loads``: every P rank that has not answered, a lost one included, is
told to stop, and the load holds its blocks until each answered or its wait ran out). Load states (``states.LoadState``): RESOLVING (handshake on the task pool; a room whose
prefill DP rank is not registered yet waits in ``dp_wait``, holding no thread) -> AWAITING_KV ->
RECEIVED or FAILED (the load then leaves the table). A load that ends before P was asked, and a
request that ends before its load, tell P to free the room (``room_release``).

Device ordering (``device_sync``): a P rank sends ``TransferDone`` only after its backend write
returned, i.e. the bytes are in D's device memory; a load that needs the NHD permutation
(``nhd_reshuffle``) runs it on a task-pool thread bound to this rank's device and waits for that
thread's stream on the KV's device before the request goes to the outbox, so vLLM's stream never
reads half-permuted blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Sequence

from pd_connector import messages as proto
from pd_connector.bootstrap.client import BootstrapError, RouteCache
from pd_connector.layouts.kv_groups import real_blocks, received_bytes, recv_groups
from pd_connector.layouts.regions import LayoutError
from pd_connector.messages import DoneStatus
from pd_connector.metadata import RecvJob
from pd_connector.transfer.checksum import landed_problem
from pd_connector.transfer.context import RankContext
from pd_connector.transfer.dp_wait import DpRankPending, DpRankWait
from pd_connector.transfer.hello import hello_of
from pd_connector.transfer.loads import Load, lost_wait_s, stop_wait_s
from pd_connector.transfer.nhd_reshuffle import plan_slices
from pd_connector.transfer.prefill_ranks import PrefillRanks
from pd_connector.transfer.room_release import RoomRelease
from pd_connector.transfer.states import LoadState
from pd_connector.transfer.stats import FailureReason, reason_of_status
from pd_connector.transfer.wire_checks import BadEndpoint
from pd_connector.transfer.write_guard import check_own_blocks

logger = logging.getLogger(__name__)

#: Loads that wait on P ranks (liveness watches those ranks).
_WAITING = (LoadState.AWAITING_KV, LoadState.CANCELLING)


class DecodeSide:
    def __init__(self, ctx: RankContext, descriptor: bytes, peer_id: str, endpoint: str) -> None:
        self._ctx = ctx
        self._cfg = ctx.cfg
        self._spec = ctx.spec
        self._descriptor = descriptor
        self._peer_id = peer_id
        self._endpoint = endpoint
        self._lock = threading.Lock()
        self._loads: dict[str, Load] = {}
        self._hello_sent: set[str] = set()
        self._hello_lock = threading.Lock()
        self._ask_lock = threading.Lock()  # orders a load's TransferRequest before its TransferCancel
        self._routes = RouteCache.for_config(self._cfg)  # its token, CA bundle, trusted hosts
        self._dp_wait = DpRankWait(self._routes, self._dp_rank_found)
        self._ranks = PrefillRanks(self._cfg, self._spec, self._routes)  # which P ranks to ask
        self._release_rooms = RoomRelease(ctx, self._routes, peer_id, self._ranks.contacts)

    def add_recvs(self, jobs: Sequence[RecvJob]) -> None:
        """Start fetching these requests' KV (the handshake runs off the step loop)."""
        now = time.monotonic()
        for job in jobs:
            with self._lock:
                self._loads[job.req_id] = Load(job, now + self._cfg.kv_wait_timeout_s)
            self._release_rooms.loaded(job.room)
            trace = self._ctx.traces.get(job.req_id, job.room, job.req_id)
            if job.arrival_time is not None:
                trace.mark("received", job.arrival_time)
            trace.mark("admitted", job.admitted_at)
            trace.trace_headers = job.trace_headers
            self._ctx.submit(self._start, job)

    def loads_waiting(self) -> int:
        """Loads this rank still waits for (handshake or KV)."""
        with self._lock:
            return len(self._loads)

    def on_scheduled(self, req_id: str, at: float) -> None:
        """D's scheduler scheduled the request after its KV arrived: its phase trace is complete."""
        if self._ctx.traces.has(req_id):
            self._ctx.traces.get(req_id, 0).mark("scheduled", at)
            self._ctx.traces.emit(req_id)

    # ------------------------------------------------------------- handshake

    def _start(self, job: RecvJob) -> None:
        try:
            check_own_blocks(real_blocks(recv_groups(job)), self._spec.num_blocks)  # transfer.write_guard
            asked = self._ranks.resolve(job)
        except DpRankPending:
            self._park(job)
            return
        except (BootstrapError, LayoutError, BadEndpoint) as exc:  # BadEndpoint: a rank registered a bad address
            self._routes.invalidate(job.bootstrap_addr)
            self._fail(job.req_id, str(exc), "mismatch" if isinstance(exc, LayoutError) else "peer_lost")
            return
        except Exception as exc:  # noqa: BLE001
            logger.exception("room=%d req=%s: handshake error", job.room, job.req_id)
            self._fail(job.req_id, f"internal error: {exc!r}", "protocol_error")
            return
        request = proto.TransferRequest(
            room=job.room,
            request_id=job.req_id,
            peer_id=self._peer_id,
            dst_block_ids=list(job.dst_block_ids),
            start_block=job.start_block,
            endpoint=self._endpoint,
            dst_groups=[list(g) for g in job.dst_group_block_ids],
            want_checksum=self._cfg.verify_kv,
        )
        endpoints = asked.endpoints
        # Under the ask lock from the state change to the last send: a cancel that sees AWAITING_KV sends
        # its TransferCancel only after this request left (cancel, _fail), so P never gets it first.
        ask = False
        with self._ask_lock:
            with self._lock:
                load = self._loads.get(job.req_id)
                if load is not None and load.cancelled:  # aborted while resolving: P gets only the cancel
                    del self._loads[job.req_id]
                elif load is not None:
                    ask = True
                    load.endpoints, load.rank_at = list(endpoints), endpoints
                    load.p_tp, load.timing = asked.p_tp, asked.timing
                    if self._ctx.reshuffle is not None:  # the parts of D's blocks P's ranks write (nhd_reshuffle)
                        load.slices = plan_slices(
                            self._spec, asked.p_tp, self._spec.tp_size, self._spec.tp_rank, job.room
                        )
                    load.state = LoadState.AWAITING_KV
                    load.handshake_s = time.monotonic() - load.started
            if ask:
                for endpoint in endpoints:
                    with self._hello_lock:  # the hello must leave before any request to that endpoint
                        if endpoint not in self._hello_sent:
                            self._ctx.send(endpoint, self._hello())
                            self._hello_sent.add(endpoint)
                    self._ctx.send(endpoint, request)
        if load is None:  # failed (timeout) while resolving: P is told to free the room
            self._cancel_at(endpoints, job.room, job.req_id)
            return
        if not ask:  # aborted while resolving
            self._cancel_at(endpoints, job.room, job.req_id)
            self._release(load, "request aborted before prefill was asked", "aborted")
            return
        self._ctx.traces.get(job.req_id, job.room).mark("asked_p")
        logger.debug(
            "room=%d req=%s: asked %s for %d blocks", job.room, job.req_id, list(endpoints), len(job.dst_block_ids)
        )

    def _park(self, job: RecvJob) -> None:
        """No DP rank registered for the room yet: the load waits in dp_wait, this thread goes back."""
        with self._lock:  # parked under the lock: a load that ends meanwhile is never left there
            load = self._loads.get(job.req_id)
            if load is not None and not load.cancelled:
                self._dp_wait.park(job)
                return
            if load is not None:
                del self._loads[job.req_id]
        self._release_rooms.release(job, "request ended before prefill's DP rank for the room was known")
        if load is not None:
            self._release(load, "request aborted before prefill was asked", "aborted")

    def _dp_rank_found(self, job: RecvJob, dp_rank: int) -> None:
        """dp_wait's thread: the room's DP rank is known; the handshake goes on, on the task pool."""
        job = dataclasses.replace(job, prefill_dp_rank=dp_rank)
        with self._lock:
            load = self._loads.get(job.req_id)
            if load is not None:
                load.job = job
        self._ctx.submit(self._start, job)

    def _hello(self) -> proto.PeerHello:
        return hello_of(self._spec, self._ctx.regions, self._peer_id, self._descriptor, self._endpoint)

    def _cancel_at(self, endpoints: Iterable[str], room: int, req_id: str) -> None:
        """Tell these P ranks to stop serving (or never serve) ``req_id``'s part of ``room``."""
        cancel = proto.TransferCancel(room=room, request_id=req_id, peer_id=self._peer_id)
        with self._ask_lock:  # after the request, if _start is sending it now
            for endpoint in endpoints:
                self._ctx.send(endpoint, cancel)

    # ------------------------------------------------------------- outcomes

    def cancel(self, req_ids: Iterable[str]) -> None:
        """vLLM finished these requests (aborted, e.g. the client went away): stop their loads.

        P is told at once (TransferCancel) and frees the room; the load ends when every P rank asked
        has answered (no write is in flight into blocks vLLM will reuse), or after ``loads.stop_wait_s``
        (by the bounds the P ranks asked advertised, ``Load.timing``).
        """
        now = time.monotonic()
        for req_id in req_ids:
            with self._lock:
                load = self._loads.get(req_id)
                if load is None or load.cancelled:
                    continue
                load.cancelled = True
                parked = self._dp_wait.drop(req_id) if load.state is LoadState.RESOLVING else None
                if parked is not None:  # waiting for the room's DP rank: ends now
                    del self._loads[req_id]
                elif load.state is not LoadState.AWAITING_KV:
                    continue  # RESOLVING: _start sends the cancel once P's ranks are known
                else:
                    load.state, load.wait_s = LoadState.CANCELLING, stop_wait_s(self._cfg, load.timing)
                    load.deadline = now + load.wait_s  # not sooner: P may still be writing
                endpoints = list(load.endpoints)
            if parked is not None:
                self._release_rooms.release(parked, "request aborted while prefill's DP rank for the room was unknown")
                self._release(load, "request aborted before prefill was asked", "aborted")
                continue
            logger.warning("room=%d req=%s: request aborted while its KV loads; cancelling it", load.job.room, req_id)
            self._cancel_at(endpoints, load.job.room, req_id)

    def _settle(self, load: Load, ranks: Iterable[int]) -> bool:
        """P ranks of a stopping load that answered; True once every P rank asked did (the load then
        left the table). Caller holds the lock."""
        load.answered.update(ranks)
        if load.stopped and self._loads.get(load.job.req_id) is load:
            del self._loads[load.job.req_id]
            return True
        return False

    def _end_stopped(self, load: Load, how: str) -> None:
        """A stopping load left the table: vLLM gets it as failed, with why it failed or was aborted."""
        reason, why = load.failure or ("request aborted", "aborted")
        self._release(load, f"{reason}; {how}", why)

    def on_done(self, done: proto.TransferDone) -> None:
        with self._lock:
            load = self._loads.get(done.request_id)
            if load is not None and load.state is LoadState.CANCELLING and load.job.room == done.room:
                released = self._settle(load, [load.p_rank(done)])
            else:
                load, released = None, False
        if load is not None:
            if released:
                self._end_stopped(load, "prefill answered")
            return
        if not done.ok:
            if done.status is DoneStatus.UNKNOWN_PEER:
                with self._hello_lock:
                    self._hello_sent.clear()  # P restarted: introduce ourselves again next time
            stage = f" pp={done.pp_rank}" if done.pp_rank else ""
            why = reason_of_status(done.status)
            self._fail(done.request_id, f"prefill rank tp={done.tp_rank}{stage}: {done.error}", why, done)
            return
        with self._lock:
            load = self._loads.get(done.request_id)
            if load is None or load.job.room != done.room:
                logger.warning("room=%d req=%s: late or unknown TransferDone ignored", done.room, done.request_id)
                return
            load.done.add(load.p_rank(done))
            load.reports[load.p_rank(done)] = (done.nbytes, done.checksum)
            if not load.complete:
                return
            del self._loads[done.request_id]
            load.state = LoadState.RECEIVED
        if len(load.slices) > 1 or self._cfg.verify_kv:  # permute / checksum the blocks off the listener
            self._ctx.submit(self._reformat_then_publish, load)
            return
        if self._landed(load):
            self._publish_received(load)

    def _landed(self, load: Load) -> bool:
        """What P's ranks reported adds up to this load (bytes; checksum with verify_kv), else it fails."""
        problem = landed_problem(self._ctx, load.job, load.reports)  # transfer.checksum
        if problem is not None:
            self._release(load, problem, "protocol_error")  # its blocks go back as failed: never cached
        return problem is None

    def _reformat_then_publish(self, load: Load) -> None:
        """Task pool (bound to the rank's device): permute, wait for the device, then hand to vLLM."""
        job = load.job
        if not self._landed(load):  # checked before the permutation: P's checksum is of what it wrote
            return
        if len(load.slices) <= 1:
            self._publish_received(load)
            return
        assert self._ctx.reshuffle is not None
        try:
            self._ctx.reshuffle.reformat(job.dst_block_ids, load.slices)
        except Exception:  # noqa: BLE001 - the blocks are unusable; vLLM recomputes or fails
            logger.exception("room=%d req=%s: KV load failed: reformatting the received blocks", job.room, job.req_id)
            self._ctx.outbox.received(job.req_id, failed_blocks=real_blocks(recv_groups(job)))
            return
        self._publish_received(load)

    def _publish_received(self, load: Load) -> None:
        done = load.job
        self._ctx.traces.get(done.req_id, done.room).mark("kv_ready")
        self._ctx.outbox.received(done.req_id)  # vLLM first (its next step schedules the request), then the books
        nbytes = received_bytes(self._ctx.regions, self._spec.region_groups, recv_groups(load.job))
        self._ctx.stats.observe_recv(nbytes, load.handshake_s)
        logger.info("room=%d req=%s: KV received (%d blocks)", done.room, done.req_id, len(done.dst_block_ids))

    def _fail(
        self, req_id: str, reason: str, why: FailureReason, answer: proto.TransferDone | None = None, lost: str = ""
    ) -> None:
        """End a load as failed (``answer``: the failing P rank's; ``lost``: a P rank gone silent). P ranks
        asked that have not answered are told to stop, the lost one too (it may only be cut off from
        answering), and the load keeps its blocks (CANCELLING) until each answered or ``loads.stop_wait_s``
        (``lost_wait_s`` after a loss) passed: only then can vLLM reuse them."""
        parked: RecvJob | None = None  # the job, if it waited for the room's DP rank (P may hold the room)
        with self._lock:
            load = self._loads.get(req_id)
            if load is None or load.state is LoadState.CANCELLING:
                return
            stopped = {load.p_rank(answer)} if answer is not None and answer.room == load.job.room else set()
            if lost in load.rank_at:
                load.lost.add(load.rank_at[lost])  # not stopped: it may still be writing (lost_wait_s)
            if load.state is LoadState.AWAITING_KV:
                load.state, load.failure = LoadState.CANCELLING, (reason, why)
                wait = lost_wait_s if load.lost else stop_wait_s
                load.wait_s = wait(self._cfg, load.timing)
                load.deadline = time.monotonic() + load.wait_s
                released = self._settle(load, stopped)
            else:  # RESOLVING: no P rank was asked
                released = self._loads.pop(req_id, None) is not None
                parked = self._dp_wait.drop(req_id)
            writing = [ep for ep, rank in load.rank_at.items() if rank not in load.answered | load.done]
        if parked is not None:
            self._release_rooms.release(parked, reason)
        self._cancel_at(writing, load.job.room, req_id)  # they must stop writing into blocks vLLM will reuse
        if released:
            self._release(load, reason, why)
        else:
            logger.info(
                "room=%d req=%s: %s; blocks held until prefill stops (at most %.1f s)", load.job.room, req_id, reason,
                load.wait_s,
            )  # fmt: skip

    def _release(self, load: Load, reason: str, why: FailureReason) -> None:
        """Hand a load that left the table to vLLM as failed (its blocks in failed_recving)."""
        load.state = LoadState.FAILED
        req_id = load.job.req_id
        # Logged before vLLM can see the request finished, so the reason is in the log by then.
        log = logger.warning if why == "aborted" and load.cancelled else logger.error
        log("room=%d req=%s: KV load failed: %s", load.job.room, req_id, reason)
        self._ctx.stats.fail(why, "recvs_failed")
        self._ctx.traces.emit(req_id, f"failed:{why}")
        self._ctx.outbox.received(req_id, failed_blocks=real_blocks(recv_groups(load.job)))

    # ------------------------------------------------------------- liveness, abandoned rooms

    def peers_waited_on(self) -> set[str]:
        """Endpoints of the P ranks this rank's loads wait on (liveness pings them): not those that already
        answered, nor one a load already declared lost (only its answer or the load's wait ends that)."""
        with self._lock:
            return {
                ep
                for load in self._loads.values()
                if load.state in _WAITING
                for ep in load.endpoints
                if load.rank_at.get(ep) not in load.lost | load.answered | load.done
            }

    def peer_lost(self, endpoint: str, silent_s: float) -> None:
        """The P rank at ``endpoint`` sent nothing for ``silent_s`` (no Pong, no Ping): the loads waiting on
        it fail. Silence says only that its frames do not reach D: it may be alive, its answers cut, and
        still write. So it does not count as stopped: it gets a ``TransferCancel`` like any P rank that has
        not answered (best effort), and the load keeps its blocks until it answers or for
        ``loads.lost_wait_s`` (``_fail``). A load already stopping told it to stop then, and its wait
        already covers it: the rank is only no longer watched for it."""
        with self._lock:
            hit = [load for load in self._loads.values() if load.state in _WAITING and endpoint in load.endpoints]
        with self._hello_lock:
            self._hello_sent.discard(endpoint)  # a P restarted there must get the hello again
        why = f"prefill rank {endpoint} silent for {silent_s:.1f} s (peer_timeout_s {self._cfg.peer_timeout_s:g})"
        for load in hit:
            self._routes.invalidate(load.job.bootstrap_addr)
            self._release_rooms.lost(load.job.bootstrap_addr)
            if load.state is not LoadState.CANCELLING:
                self._fail(load.job.req_id, why, "peer_lost", lost=endpoint)
                continue
            with self._lock:
                if endpoint in load.rank_at:
                    load.lost.add(load.rank_at[endpoint])
            logger.warning(
                "room=%d req=%s: %s while its load stops; blocks held until it answers or for %.1f s in all",
                load.job.room, load.job.req_id, why, load.wait_s,
            )  # fmt: skip

    def abandon(self, jobs: Sequence[RecvJob]) -> None:
        """vLLM finished these requests before their KV was asked for (the client went away while they
        queued): tell P, which may hold the room for them, to free it (off the step loop: room_release)."""
        self._release_rooms.abandon(jobs)

    def expire(self, now: float) -> None:
        with self._lock:
            timed_out = [load for load in self._loads.values() if load.deadline <= now]
        for load in timed_out:
            if load.state is LoadState.CANCELLING:
                with self._lock:
                    gone = self._loads.pop(load.job.req_id, None)
                if gone is not None:
                    self._end_stopped(load, f"prefill did not answer within {load.wait_s:g} s")
                continue
            if self._dp_wait.parked(load.job.req_id):
                why = f"prefill registered no DP rank for room {load.job.room} within {self._cfg.kv_wait_timeout_s:g} s"
            else:
                why = f"no KV from prefill within {self._cfg.kv_wait_timeout_s:g} s"
                self._routes.invalidate(load.job.bootstrap_addr)
            self._fail(load.job.req_id, why, "timeout")
