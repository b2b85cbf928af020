"""PrefillSide: a P rank's rooms and the pushes of their KV into D's blocks.

A room becomes sendable when both halves are here, in either order: the scheduler's `SendJob`
(prefill done, KV queued into these blocks) and D's `TransferRequest` (write into those blocks). The
write (``room_push``) runs on the task pool (its threads bound to the rank's device) once the device
marker recorded with the `SendJob` completed (``device_sync``: the forward's KV is in memory), then `TransferDone` goes to D and the request goes to the outbox
so vLLM frees P's blocks. A room nobody asks for is freed after room_timeout_s (its job's hold_s if set).

Every room's life is here: the table, the lock, every ``states.RoomState`` move (the states and the
``Room`` record: ``rooms``), and the claims of both modes: a request-mode push (``room_push``) or a
layer-wise stream (``layerwise``: this class is its ``StreamHost``, taking the room's waiting
requests and counting each one's end). A closed room remembers its ``CloseReason`` for a D request
that comes later. Room ends from outside a D request (aborted prefills, expiry, a release because the
client's request ended, shutdown) are in the base class (``room_ends``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence

from pd_connector import messages as proto
from pd_connector.auth import token_of
from pd_connector.bootstrap.client import register_dp_rank
from pd_connector.compat import peer_problem, version_problem
from pd_connector.kv_params import host_port
from pd_connector.layouts.pp import PipelineError, localize_hello
from pd_connector.messages import DoneStatus
from pd_connector.metadata import SendJob
from pd_connector.transfer.backend import TransferBackend, describe
from pd_connector.transfer.checksum import RunningChecksum
from pd_connector.transfer.context import RankContext
from pd_connector.transfer.device_sync import Marker
from pd_connector.transfer.layerwise import LayerStreams
from pd_connector.transfer.liveness import claims_toward, decode_peers_waited_on
from pd_connector.transfer.room_ends import RoomEnds
from pd_connector.transfer.room_push import PushOutcome, StreamResult, log_push, push_room
from pd_connector.transfer.rooms import ClaimKey, ClosedRooms, Room, WaitingRequest, remember
from pd_connector.transfer.states import CloseReason, RoomState
from pd_connector.transfer.stats import reason_of_status
from pd_connector.transfer.write_guard import WriteGuard, guard_push
from pd_connector.transfer.write_plans import expected_requests_from

logger = logging.getLogger(__name__)

#: How long a D request for a room that was already closed (sent, expired, aborted) waits for a new
#: prefill of the same room before it is refused with the reason the room was closed.
CLOSED_ROOM_GRACE_S = 5.0
_CANCELLED = "decode cancelled the transfer"


class PrefillSide(RoomEnds):
    def __init__(self, ctx: RankContext, backend: TransferBackend) -> None:
        self._ctx = ctx
        self._cfg = ctx.cfg
        self._spec = ctx.spec
        self._backend = backend
        self._lock = threading.Lock()
        self._rooms: dict[int, Room] = {}  # rooms not CLOSED
        self._closed = ClosedRooms(self._cfg.room_timeout_s)
        # D requests cancelled before their room's prefill finished: room -> their claims.
        self._early_cancels: OrderedDict[int, set[ClaimKey]] = OrderedDict()
        self._peers: dict[str, proto.PeerHello] = {}
        self._peer_errors: dict[str, str] = {}
        # READY rooms: the device marker their pushes wait for (the forward that wrote the KV ran).
        self._forward_done: dict[int, Marker] = {}
        self.layers: LayerStreams | None = None  # transfer_mode "layer" (enable_layer_push)

    # ------------------------------------------------------------ from the worker

    def add_sends(self, jobs: Sequence[SendJob], forward_done: Marker | None = None) -> None:
        """These rooms finished prefill; send each as soon as its D ranks ask.

        ``forward_done``: a device marker behind the forwards that wrote their KV; every push of these
        rooms waits for it before the first byte moves (None: the KV is in memory already, CPU)."""
        now = time.monotonic()
        for job in jobs:
            ready = Room(job.room, RoomState.READY, job, now + job.hold_seconds(self._cfg.room_timeout_s))
            with self._lock:
                old = self._rooms.get(job.room)
                if old is not None and old.state is not RoomState.AWAITING_PREFILL:
                    # A room is one prompt's KV: never replaced (the held one would never be freed).
                    self._ctx.outbox.sent(job.req_id)
                    holder = old.job.req_id if old.job is not None else "?"
                    logger.error(
                        "room=%d req=%s: room is in use by req=%s; refusing this prefill, its KV is freed",
                        job.room, job.req_id, holder,
                    )  # fmt: skip
                    self._ctx.stats.inc("rooms_refused")
                    continue
                waiting = old.waiting if old is not None else []
                if old is not None and old.submitted_ids:  # claims layer-wise streams took
                    ready.expected = self._expected(job, ready.carry_streamed(old))
                if old is not None and old.released:  # released while its streams wrote: no new request
                    ready.released, ready.state = old.released, RoomState.DRAINING
                ready.cancelled = self._early_cancels.pop(job.room, set())
                if ready.cancelled:
                    ready.expected = self._expected(job, waiting[0].req.peer_id if waiting else None)
                cancelled = (
                    not waiting
                    and not ready.submitted_ids
                    and (ready.served if ready.cancelled else self._closed.get(job.room) is CloseReason.CANCELLED)
                )
                if cancelled:  # D gave up (or the client's request ended) before this prefill finished
                    self._rooms.pop(job.room, None)
                    self._closed.add(job.room, CloseReason.CANCELLED, prefilled=True)
                    self._ctx.outbox.sent(job.req_id)
                else:
                    self._rooms[job.room] = ready
                    if forward_done is not None:
                        self._forward_done[job.room] = forward_done
            self._trace_prefill(job)
            if self.layers is not None:
                self.layers.release(job.room)  # later D requests: request mode
                if ready.submitted_ids:
                    with self._lock:
                        self._finish_if_served(ready)
            if cancelled:
                who = "the room was released" if self._closed.released(job.room) else "decode had cancelled"
                logger.warning("room=%d req=%s: %s; freeing the KV now", job.room, job.req_id, who)
                self._ctx.traces.emit(job.room, "cancelled")
                continue
            logger.debug("room=%d req=%s: prefill done, %d blocks ready", job.room, job.req_id, len(job.block_ids))
            if self._spec.dp_size > 1 and self._spec.tp_rank == 0 and self._spec.pp_rank == 0:
                # D ranks told no prefill_dp_rank look the room up on the bootstrap server.
                addr = host_port(self._cfg.bootstrap_host, self._cfg.bootstrap_port)
                timeout, token, ca = self._cfg.http_timeout_s, token_of(self._cfg), self._cfg.bootstrap_ssl_ca_certs
                self._ctx.submit(register_dp_rank, addr, job.room, self._spec.dp_rank, timeout, token, ca)
            for w in waiting:
                with self._lock:
                    accepted = self._accept(ready, w.req)
                self._start_push(ready, w.req, accepted)

    def _trace_prefill(self, job: SendJob) -> None:
        trace = self._ctx.traces.get(job.room, job.room, job.req_id)
        if job.arrival_time is not None:
            trace.mark("received", job.arrival_time)
        trace.mark("prefill_done", job.prefill_done_at)
        trace.trace_headers = job.trace_headers

    def rooms_held(self) -> int:
        """Rooms whose KV this rank holds (prefill done, not yet freed)."""
        with self._lock:
            return sum(1 for room in self._rooms.values() if room.state is not RoomState.AWAITING_PREFILL)

    # ------------------------------------------------------------ from D ranks

    def on_hello(self, hello: proto.PeerHello) -> None:
        try:  # a pipeline stage keeps D's regions of its own layers (layouts.pp)
            hello = localize_hello(self._spec.region_layers, self._spec.pp_size, hello)
            error = version_problem(hello) or peer_problem(self._spec, self._ctx.regions, hello)
        except PipelineError as exc:
            error = f"incompatible decode instance {hello.peer_id}: {exc}"
        if error:
            logger.error("%s", error)
        with self._lock:
            self._peers[hello.peer_id] = hello
            if error:
                self._peer_errors[hello.peer_id] = error
            else:
                self._peer_errors.pop(hello.peer_id, None)
        logger.info(
            "decode peer %s registered (transfer descriptor %s)", hello.peer_id, describe(hello.transfer_descriptor)
        )

    def on_transfer_request(self, req: proto.TransferRequest) -> None:
        self._ctx.traces.get(req.room, req.room).mark_first("d_asked")
        closed: CloseReason | None = None
        accepted = waits = False
        with self._lock:
            room = self._rooms.get(req.room)
            aborted = room is None and self._closed.get(req.room) is CloseReason.ABORTED
            released = room.released if room is not None else self._closed.released(req.room)
            repeated = room is not None and room.has_claim(ClaimKey.of(req))
            if repeated:
                pass  # a claim already taken (a replayed or repeated request): its first copy gets the answer
            elif released or aborted:
                pass  # the client's request ended, or the prefill was aborted: D's load fails at once
            elif room is not None and room.state is not RoomState.AWAITING_PREFILL:
                accepted = self._accept(room, req)
            else:
                # A closed room may be reused by a new request whose prefill has not finished yet
                # (a client that sends its own room twice): wait a short grace before refusing.
                waits = True
                closed = self._closed.get(req.room)
                timeout = self._cfg.room_timeout_s
                wait_s = min(CLOSED_ROOM_GRACE_S, timeout) if closed is not None else timeout
                if room is None:
                    room = self._rooms[req.room] = Room(req.room, RoomState.AWAITING_PREFILL)
                room.waiting.append(WaitingRequest(req, time.monotonic() + wait_s, closed))
        if repeated:
            self._ctx.stats.inc("bad_frames")
            logger.warning(
                "room=%d req=%s: refusing a repeated TransferRequest from %s: the room already has this claim",
                req.room, req.request_id, req.peer_id,
            )  # fmt: skip
            return
        if released:
            self._reply(req, DoneStatus.ROOM_CLOSED, f"prefill released room {req.room}: {released}")
            return
        if aborted:
            self._reply(req, DoneStatus.ABORTED, CloseReason.ABORTED.message(self._cfg.room_timeout_s))
            return
        if not waits:
            assert room is not None
            self._start_push(room, req, accepted)
            return
        logger.debug(
            "room=%d req=%s: decode asked before prefill finished%s",
            req.room,
            req.request_id,
            f" (room closed before: {self._closed.message(req.room, closed)})" if closed else "",
        )
        if self.layers is not None:
            self.layers.offer(req.room)  # a running layer-wise stream takes it

    def on_cancel(
        self, cancel: proto.TransferCancel, status: DoneStatus = DoneStatus.CANCELLED, why: str = _CANCELLED
    ) -> None:
        """D gave up one request of the room (abort, timeout, failed load; or went silent: ``peer_lost``):
        it counts as claimed, its write (if any) stops, and the room is freed at once when no other
        request is expected. A request of it still waiting for the prefill is answered ``status``. A cancel
        with ``release`` (P's bootstrap server: the client's request ended) releases the whole room
        (``room_ends.RoomEnds.release_room``)."""
        if cancel.release:
            self.release_room(cancel.room, cancel.release)
            return
        dropped: list[WaitingRequest] = []
        key = ClaimKey.of(cancel)
        with self._lock:
            room = self._rooms.get(cancel.room)
            if room is None or room.state is RoomState.AWAITING_PREFILL:
                # Prefill not done yet: remember the cancel (its room is freed at once if it comes).
                remember(self._early_cancels, cancel.room, self._early_cancels.get(cancel.room, set()) | {key})
                if room is not None:
                    dropped = [w for w in room.waiting if ClaimKey.of(w.req) == key]
                    room.waiting = [w for w in room.waiting if ClaimKey.of(w.req) != key]
                if room is None or (not room.waiting and not room.submitted_ids):
                    self._rooms.pop(cancel.room, None)
                    self._closed.add(cancel.room, CloseReason.CANCELLED)
            else:
                room.cancelled.add(key)
                assert room.job is not None
                room.expected = room.expected or self._expected(room.job, cancel.peer_id)
                self._finish_if_served(room)
        logger.warning("room=%d req=%s: %s", cancel.room, cancel.request_id, why)
        for w in dropped:  # D waits for one answer per request it sent
            self._reply(w.req, status, why)
        # A layer-wise reader of the claim stops and answers once its writes ended (also one whose room
        # left the table, aborted): D must not be told before, it would free blocks a write may still land in.
        streamed = self.layers is not None and self.layers.stop(cancel.room, key, status, why)
        peer = self._peers.get(cancel.peer_id)
        if room is None and peer is not None and not streamed:  # no write of it runs: D may hold its blocks until told
            spec = self._spec
            done = proto.TransferDone(cancel.room, cancel.request_id, spec.tp_rank, status, why, pp_rank=spec.pp_rank)
            self._ctx.send(peer.endpoint, done)
        if room is None or room.state is RoomState.AWAITING_PREFILL:
            self._ctx.traces.emit(cancel.room, "cancelled")

    def peers_waited_on(self) -> set[str]:
        """Endpoints of the D ranks whose requests wait here (liveness pings them)."""
        with self._lock:
            return decode_peers_waited_on(list(self._rooms.values()), self._peers)

    def peer_lost(self, endpoint: str, silent_s: float) -> None:
        """The D rank at ``endpoint`` answered no heartbeat for ``silent_s``: every claim of it is cancelled."""
        with self._lock:
            cancels = claims_toward(endpoint, list(self._rooms.values()), self._peers)
        why = f"decode rank {endpoint} silent for {silent_s:.1f} s (peer_timeout_s {self._cfg.peer_timeout_s:g})"
        for cancel in cancels:
            self.on_cancel(cancel, DoneStatus.PEER_LOST, why)

    # ---------------------------------------------------------------- pushes

    def _expected(self, job: SendJob, peer_id: str | None) -> int:
        """Requests this rank gets for the room: per decode sample, the D ranks that read from it."""
        peer = self._peers.get(peer_id) if peer_id is not None else None
        return expected_requests_from(self._spec, job.room, peer) * job.samples

    def _accept(self, room: Room, req: proto.TransferRequest) -> bool:
        """Count one D request for a ready room; False for one too many. Caller holds the lock."""
        if room.expected == 0:
            assert room.job is not None
            room.expected = self._expected(room.job, req.peer_id)
        key = ClaimKey.of(req)
        if room.state is not RoomState.READY or key in room.cancelled or room.claimed >= room.expected:
            return False
        room.submitted += 1
        room.submitted_ids.add(key)
        return True

    def _start_push(self, room: Room, req: proto.TransferRequest, accepted: bool) -> None:
        if accepted:
            self._ctx.submit(self._push, room, req)
        else:
            self._reply(req, DoneStatus.ALREADY_SERVED, f"room {req.room} was already served")

    def _push(self, room: Room, req: proto.TransferRequest) -> None:
        job = room.job
        assert job is not None
        trace = self._ctx.traces.get(job.room, job.room, job.req_id)
        trace.mark_first("push_started")
        with self._lock:
            peer = self._peers.get(req.peer_id)
            peer_error = self._peer_errors.get(req.peer_id)
            forward_done = self._forward_done.get(job.room)
        key = ClaimKey.of(req)
        still_wanted = lambda: room.state is RoomState.READY and key not in room.cancelled  # noqa: E731
        done = push_room(self._ctx, self._backend, job, req, peer, peer_error, still_wanted, forward_done)
        try:
            self._report_push(job.req_id, req, done)
        finally:  # the write ended: the room closes even if D cannot be told (a bad endpoint raises)
            with self._lock:
                room.finished += 1
                self._finish_if_served(room)

    def _report_push(self, p_req_id: str, req: proto.TransferRequest, done: PushOutcome | StreamResult) -> None:
        """D first (its first token waits for this), then the log line; a failure is logged before D sees it."""
        ok = done.status is DoneStatus.OK
        if ok:
            self._ctx.traces.get(req.room, req.room, p_req_id).mark("push_done")
            self._reply(req, done.status, done.error, done.nbytes, done.checksum)
        log_push(self._ctx.stats, req.room, p_req_id, req, done)
        if not ok:
            self._reply(req, done.status, done.error, -1, None)

    # ------------------------------------------------- layer-wise streams (StreamHost)

    def enable_layer_push(self, layer_regions: Mapping[str, range]) -> LayerStreams:
        """Stream each layer's KV while the prefill runs (the worker feeds it save_kv_layer calls)."""
        self.layers = LayerStreams(self._ctx, self._backend, self, layer_regions)
        return self.layers

    def take_for_stream(self, room: int) -> list[proto.TransferRequest]:
        with self._lock:
            held = self._rooms.get(room)
            if held is None or held.state is not RoomState.AWAITING_PREFILL:
                return []
            return held.take_waiting()

    def peer_of(self, peer_id: str) -> tuple[proto.PeerHello | None, str | None]:
        with self._lock:
            return self._peers.get(peer_id), self._peer_errors.get(peer_id)

    def guard_of(self, peer: proto.PeerHello, req: proto.TransferRequest) -> tuple[WriteGuard, RunningChecksum | None]:
        return guard_push(peer, req, self._spec)

    def stream_done(self, p_req_id: str, done: StreamResult) -> None:
        req = done.req
        try:
            self._report_push(p_req_id, req, done)
        finally:  # the stream's writes ended: the room closes even if D cannot be told
            with self._lock:
                room = self._rooms.get(req.room)
                if room is not None and ClaimKey.of(req) in room.submitted_ids:
                    room.finished += 1
                    self._finish_if_served(room)

    # ------------------------------------------------------------- closing

    def _finish_if_served(self, room: Room) -> None:
        """Close a room and let vLLM free its blocks once every write for it ended. Caller holds the lock."""
        if room.served and self._rooms.get(room.room) is room:
            assert room.job is not None
            del self._rooms[room.room]
            self._forward_done.pop(room.room, None)
            room.state = RoomState.CLOSED
            reason = room.close_reason
            hold_s = room.job.hold_seconds(self._cfg.room_timeout_s)
            self._closed.add(room.room, reason, hold_s, room.released, prefilled=True)
            self._ctx.traces.emit(room.room, None if reason is CloseReason.SENT else reason.value)
            self._ctx.outbox.sent(room.job.req_id)

    def _reply(
        self,
        req: proto.TransferRequest,
        status: DoneStatus,
        error: str = "",
        nbytes: int = -1,
        checksum: int | None = None,
    ) -> None:
        with self._lock:
            peer = self._peers.get(req.peer_id)
        # A peer P does not know (P restarted) is answered at the endpoint its request names.
        endpoint = peer.endpoint if peer is not None else req.endpoint
        if not endpoint:
            logger.error("room=%d req=%s: cannot answer unknown peer %s", req.room, req.request_id, req.peer_id)
            return
        spec = self._spec
        done = proto.TransferDone(req.room, req.request_id, spec.tp_rank, status, error, nbytes, checksum, spec.pp_rank)
        if status is not DoneStatus.OK:
            self._count_refusal(req, status)
        self._ctx.send(endpoint, done)

    def _count_refusal(self, req: proto.TransferRequest, status: DoneStatus) -> None:
        """A request P answers with an error: count its reason; a room P does not hold ends its trace."""
        reason = reason_of_status(status)
        self._ctx.stats.fail(reason)
        traces = self._ctx.traces
        if traces.has(req.room):
            traces.get(req.room, req.room).outcome = f"failed:{reason}"
            with self._lock:
                held = req.room in self._rooms
            if not held:
                traces.emit(req.room)
