"""KVTransferManager: one per worker rank; owns the ZMQ sockets and the transfers.

P ranks: a room becomes sendable when both halves are here, in either order:
the scheduler's `SendJob` (prefill done, KV in these blocks) and D's
`TransferRequest` (write into those blocks). The write runs on a thread pool,
then `TransferDone` goes to D and the request is reported in finished_sending
so vLLM frees P's blocks. A room nobody asks for is freed after room_timeout_s.

D ranks: each `RecvJob` resolves P's topology (bootstrap route, cached), sends
`PeerHello` once per P rank and a `TransferRequest` per request, then waits for
`TransferDone` from every P rank it needs. Errors and kv_wait_timeout_s end the
wait as a failed load; vLLM then recomputes or fails the request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import zmq

from pd_connector import protocol as proto
from pd_connector.bootstrap.client import BootstrapBusy, BootstrapError, RouteCache, register_dp_rank
from pd_connector.compat import KVFacts, kv_mismatch, route_mismatch
from pd_connector.config import DisaggConfig
from pd_connector.layout import LayoutError, Region, block_runs
from pd_connector.metadata import RecvJob, SendJob
from pd_connector.tp_mapping import (
    MappingError,
    check_head_regions,
    decode_contacts,
    expected_requests,
    needs_head_split,
    plan_decode_rank,
    slices_from,
    tp_transfer_entries,
)
from pd_connector.transfer.engine import MooncakeEngine, TransferError

logger = logging.getLogger(__name__)

CLOSED_ROOMS_KEPT = 100_000
CANCELLED = "decode cancelled the transfer"
#: How long a D request for a room that was already closed (sent, expired, aborted) waits for a new
#: prefill of the same room before it is refused with the reason the room was closed.
CLOSED_ROOM_GRACE_S = 5.0
POLL_MS = 50


@dataclass(frozen=True)
class RankSpec:
    """Where this worker sits in its instance and how its KV looks."""

    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    block_size: int
    kv_dtype: str
    num_layers: int
    total_kv_heads: int = 1  # 1 for MLA
    local_kv_heads: int = 1
    use_mla: bool = False
    heads_outermost: bool = True
    model: str = ""  # compat.model_fingerprint; "" skips the model check

    @property
    def heads(self) -> int:
        """Head count the TP mapping works with (MLA's latent is one replicated head)."""
        return 1 if self.use_mla else self.total_kv_heads


@dataclass
class TransferStats:
    transfers_ok: int = 0
    transfers_failed: int = 0
    bytes_sent: int = 0
    entries_sent: int = 0
    recvs_ok: int = 0
    recvs_failed: int = 0
    rooms_expired: int = 0
    bad_frames: int = 0


@dataclass
class _ReadyRoom:
    """A finished prefill on this P rank; D ranks ask for (parts of) it, possibly several."""

    job: SendJob
    deadline: float
    expected: int = 0  # requests this rank will get for the room (0: unknown yet)
    submitted: int = 0
    finished: int = 0
    expired: bool = False

    @property
    def complete(self) -> bool:
        idle = self.finished == self.submitted
        return idle and (self.expired or (self.expected > 0 and self.submitted >= self.expected))


@dataclass
class _WaitingRequest:
    req: proto.TransferRequest
    deadline: float
    #: Why the room was closed when this request came (it waits a short grace for a new prefill).
    closed_reason: str = ""


@dataclass
class _RecvState:
    job: RecvJob
    deadline: float
    expected: int = -1  # P ranks to hear from; -1 while the handshake is running
    done: set[int] = field(default_factory=set)  # P tp ranks that reported DONE
    endpoints: list[str] = field(default_factory=list)


class KVTransferManager:
    def __init__(
        self,
        cfg: DisaggConfig,
        spec: RankSpec,
        regions: Sequence[Region],
        engine: MooncakeEngine,
    ) -> None:
        self.cfg = cfg
        self.spec = spec
        self.regions = list(regions)
        self.engine = engine
        self.stats = TransferStats()
        self.peer_id = f"{engine.session}/dp{spec.dp_rank}/tp{spec.tp_rank}"

        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port("tcp://0.0.0.0")
        self.endpoint = f"tcp://{cfg.local_ip}:{port}"
        self.rank_port = port
        self._push: dict[str, zmq.Socket] = {}
        self._push_lock = threading.Lock()

        self._lock = threading.Lock()
        # P side
        self._ready: dict[int, _ReadyRoom] = {}
        self._waiting: dict[int, list[_WaitingRequest]] = {}
        self._peers: dict[str, proto.PeerHello] = {}
        self._peer_errors: dict[str, str] = {}
        self._closed_rooms: OrderedDict[int, str] = OrderedDict()
        self._finished_sending: set[str] = set()
        # D side
        self._recvs: dict[str, _RecvState] = {}
        self._hello_sent: set[str] = set()
        self._hello_lock = threading.Lock()
        self._finished_recving: set[str] = set()
        self._failed_recving: dict[str, list[int]] = {}
        self._routes = RouteCache(cfg.http_timeout_s)

        self._pool = ThreadPoolExecutor(max_workers=cfg.transfer_threads, thread_name_prefix="pd-xfer")
        self._stop = threading.Event()
        self._progress = threading.Event()  # set whenever a request finishes sending/receiving
        self._listener = threading.Thread(target=self._listen, name="pd-listener", daemon=True)
        self._listener.start()
        logger.info("KV transfer manager (%s) listening on %s, peer %s", cfg.mode, self.endpoint, self.peer_id)

    # ------------------------------------------------------------ public API

    def add_sends(self, jobs: Sequence[SendJob]) -> None:
        """P: these rooms finished prefill; send each as soon as its D ranks ask."""
        now = time.monotonic()
        for job in jobs:
            ready = _ReadyRoom(job, now + self.cfg.room_timeout_s)
            with self._lock:
                waiting = self._waiting.pop(job.room, [])
                cancelled = not waiting and self._closed_rooms.get(job.room) == CANCELLED
                if cancelled:  # D gave up before this prefill finished: free at once
                    self._finished_sending.add(job.req_id)
                    self._progress.set()
                else:
                    self._ready[job.room] = ready
            if cancelled:
                logger.warning("room=%d req=%s: decode had cancelled; freeing the KV now", job.room, job.req_id)
                continue
            logger.debug("room=%d req=%s: prefill done, %d blocks ready", job.room, job.req_id, len(job.block_ids))
            if self.spec.dp_size > 1 and self.spec.tp_rank == 0:
                # D ranks told no prefill_dp_rank look the room up on the bootstrap server.
                addr = f"{self.cfg.bootstrap_host}:{self.cfg.bootstrap_port}"
                self._submit(register_dp_rank, addr, job.room, self.spec.dp_rank, self.cfg.http_timeout_s)
            for w in waiting:
                self._accept(ready, w.req)

    def drop_rooms(self, rooms: Sequence[int]) -> None:
        """P: these rooms will never have KV (request aborted); tell their D if it asks."""
        for room in rooms:
            with self._lock:
                self._close_room(room, "prefill request was aborted before its KV was ready")
                waiting = self._waiting.pop(room, [])
            for w in waiting:
                self._reply(w.req, ok=False, error="prefill request was aborted")

    def add_recvs(self, jobs: Sequence[RecvJob]) -> None:
        """D: start fetching these requests' KV (handshake runs off the step loop)."""
        now = time.monotonic()
        for job in jobs:
            with self._lock:
                self._recvs[job.req_id] = _RecvState(job, now + self.cfg.kv_wait_timeout_s)
            self._submit(self._start_recv, job)

    def take_finished(self) -> tuple[set[str], set[str], dict[str, list[int]]]:
        """(finished_sending, finished_recving incl. failed, failed -> their dst blocks)."""
        with self._lock:
            sending, self._finished_sending = self._finished_sending, set()
            recving, self._finished_recving = self._finished_recving, set()
            failed, self._failed_recving = self._failed_recving, {}
        return sending, recving, failed

    def wait_for_progress(self, timeout: float) -> None:
        """Block up to `timeout` s, less if a transfer finishes meanwhile (idle engine steps)."""
        with self._lock:
            if self._finished_sending or self._finished_recving:
                return
            self._progress.clear()
        self._progress.wait(timeout)

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._ready or self._recvs or self._finished_sending or self._finished_recving)

    def close(self) -> None:
        self._stop.set()
        self._listener.join(timeout=2)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._push_lock:
            for sock in self._push.values():
                sock.close(linger=0)
            self._push.clear()
        self._pull.close(linger=0)
        self._ctx.term()

    def _submit(self, fn: Callable[..., object], *args: object) -> None:
        """Run fn on the pool; an exception is logged, never silently dropped with its future."""

        def log_failure(future: Future) -> None:
            exc = future.exception()
            if exc is not None:
                logger.error("%s%r failed: %r", getattr(fn, "__name__", fn), args[:1], exc, exc_info=exc)

        try:
            self._pool.submit(fn, *args).add_done_callback(log_failure)
        except RuntimeError as exc:  # pool shut down
            logger.error("cannot run %s: %s", getattr(fn, "__name__", fn), exc)

    # -------------------------------------------------------------- listener

    def _listen(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                events = dict(poller.poll(POLL_MS))
                if self._pull in events:
                    while True:
                        try:
                            frame = self._pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_frame(frame)
                self._expire(time.monotonic())
            except zmq.ContextTerminated:
                return
            except Exception:  # noqa: BLE001 - the listener must survive anything
                logger.exception("KV transfer listener error (continuing)")

    def _on_frame(self, frame: bytes) -> None:
        try:
            msg = proto.decode(frame)
        except proto.ProtocolError as exc:
            self.stats.bad_frames += 1
            logger.warning("dropping malformed ZMQ frame on %s: %s", self.endpoint, exc)
            return
        handler: dict[type, Callable] = {
            proto.PeerHello: self._on_hello,
            proto.TransferRequest: self._on_transfer_request,
            proto.TransferDone: self._on_done,
            proto.TransferCancel: self._on_cancel,
        }
        handler[type(msg)](msg)

    # ------------------------------------------------------------------ P side

    def _on_hello(self, hello: proto.PeerHello) -> None:
        if not self.cfg.is_prefill:
            logger.warning("decode rank got a PeerHello from %s; ignored", hello.peer_id)
            return
        error = ""
        try:
            ours = KVFacts(self.spec.block_size, self.spec.kv_dtype, self.spec.num_layers)
            theirs = KVFacts(hello.block_size, hello.kv_dtype, hello.num_layers)
            problem = kv_mismatch("this prefill instance", ours, f"decode instance {hello.peer_id}", theirs)
            if problem is not None:
                raise LayoutError(problem)
            if (hello.total_kv_heads, hello.use_mla) != (self.spec.total_kv_heads, self.spec.use_mla):
                raise LayoutError(
                    f"model mismatch: prefill has {self.spec.total_kv_heads} KV heads (MLA {self.spec.use_mla}), "
                    f"decode {hello.total_kv_heads} (MLA {hello.use_mla})"
                )
            check_head_regions(
                self.regions, [Region(*r) for r in hello.regions], self.spec.local_kv_heads, hello.local_kv_heads
            )
            plan = plan_decode_rank(
                self.spec.heads, self.spec.tp_size, hello.tp_size, hello.tp_rank, is_mla=self.spec.use_mla
            )
            if needs_head_split(plan, self.spec.local_kv_heads, hello.local_kv_heads) and not (
                self.spec.heads_outermost and hello.heads_outermost
            ):
                raise MappingError(
                    f"prefill TP {self.spec.tp_size} / decode TP {hello.tp_size} split KV heads inside a block, "
                    "but the KV layout keeps heads inside tokens (NHD); use equal TP sizes"
                )
        except LayoutError as exc:
            error = f"incompatible decode instance {hello.peer_id}: {exc}"
            logger.error("%s", error)
        with self._lock:
            self._peers[hello.peer_id] = hello
            if error:
                self._peer_errors[hello.peer_id] = error
            else:
                self._peer_errors.pop(hello.peer_id, None)
        logger.info("decode peer %s registered (session %s)", hello.peer_id, hello.session)

    def _on_transfer_request(self, req: proto.TransferRequest) -> None:
        if not self.cfg.is_prefill:
            return
        with self._lock:
            ready = self._ready.get(req.room)
            closed = self._closed_rooms.get(req.room, "") if ready is None else ""
            if ready is None:
                # A closed room may be reused by a new request whose prefill has not finished yet
                # (a client that sends its own room twice): wait a short grace before refusing.
                wait_s = min(CLOSED_ROOM_GRACE_S, self.cfg.room_timeout_s) if closed else self.cfg.room_timeout_s
                waiting = _WaitingRequest(req, time.monotonic() + wait_s, closed)
                self._waiting.setdefault(req.room, []).append(waiting)
        if ready is not None:
            self._accept(ready, req)
        else:
            logger.debug(
                "room=%d req=%s: decode asked before prefill finished%s",
                req.room,
                req.request_id,
                f" (room closed before: {closed})" if closed else "",
            )

    def _expected_requests(self, room: int, peer: proto.PeerHello | None) -> int:
        if peer is None:
            return 1
        try:
            return expected_requests(
                self.spec.heads,
                self.spec.tp_size,
                peer.tp_size,
                self.spec.tp_rank,
                is_mla=self.spec.use_mla,
                spread=room % self.spec.tp_size,
            )
        except LayoutError:
            return 1

    def _accept(self, ready: _ReadyRoom, req: proto.TransferRequest) -> None:
        """Take one D rank's request for a ready room: submit its write, or refuse an extra one."""
        with self._lock:
            if ready.expected == 0:
                ready.expected = self._expected_requests(ready.job.room, self._peers.get(req.peer_id))
            extra = ready.submitted >= ready.expected or ready.expired
            if not extra:
                ready.submitted += 1
        if extra:
            self._reply(req, ok=False, error=f"room {req.room} was already served")
            return
        self._submit(self._send, ready, req)

    def _on_cancel(self, cancel: proto.TransferCancel) -> None:
        with self._lock:
            self._waiting.pop(cancel.room, None)
            ready = self._ready.get(cancel.room)
            if ready is None:
                self._close_room(cancel.room, CANCELLED)
            else:
                # Nothing more will come for this room: free it once in-flight writes end.
                ready.expired = True
                self._finish_room_if_done(ready)
        logger.warning("room=%d req=%s: decode cancelled the transfer", cancel.room, cancel.request_id)

    def _send(self, ready: _ReadyRoom, req: proto.TransferRequest) -> None:
        job = ready.job
        t0 = time.perf_counter()
        error = ""
        nbytes = entries = 0
        try:
            with self._lock:
                peer = self._peers.get(req.peer_id)
                peer_error = self._peer_errors.get(req.peer_id)
            if peer is None:
                raise TransferError(f"unknown decode peer {req.peer_id} (no PeerHello received)")
            if peer_error:
                raise TransferError(peer_error)
            if req.dst_block_ids:
                end = req.start_block + len(req.dst_block_ids)
                if req.start_block < 0 or end > len(job.block_ids):
                    raise TransferError(
                        f"decode asks for blocks {req.start_block}..{end - 1} but prefill holds "
                        f"{len(job.block_ids)} blocks ({job.num_tokens} tokens): prompts differ?"
                    )
                plan = plan_decode_rank(
                    self.spec.heads,
                    self.spec.tp_size,
                    peer.tp_size,
                    peer.tp_rank,
                    is_mla=self.spec.use_mla,
                    spread=job.room % self.spec.tp_size,
                )
                slices = slices_from(plan, self.spec.tp_rank)
                if slices:  # else this rank only frees the room (no D rank reads from it)
                    runs = block_runs(job.block_ids[req.start_block : end], req.dst_block_ids)
                    peer_regions = [Region(*r) for r in peer.regions]
                    src, dst, lengths = tp_transfer_entries(
                        self.regions, peer_regions, slices, self.spec.local_kv_heads, peer.local_kv_heads, runs
                    )
                    self.engine.write(
                        peer.session, src, dst, lengths, self.cfg.max_batch_entries, lambda: not ready.expired
                    )
                    nbytes, entries = sum(lengths), len(lengths)
        except (TransferError, LayoutError) as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - report, never leak the room
            logger.exception("room=%d req=%s: unexpected send error", job.room, job.req_id)
            error = f"internal error: {exc!r}"
        ms = (time.perf_counter() - t0) * 1e3
        if error:
            self.stats.transfers_failed += 1
            logger.error("room=%d req=%s: KV push to %s failed: %s", job.room, job.req_id, req.peer_id, error)
        else:
            self.stats.transfers_ok += 1
            self.stats.bytes_sent += nbytes
            self.stats.entries_sent += entries
            logger.info(
                "room=%d req=%s: pushed %d blocks (%d bytes, %d entries) to %s in %.2f ms",
                job.room,
                job.req_id,
                len(req.dst_block_ids),
                nbytes,
                entries,
                req.peer_id,
                ms,
            )
        self._reply(req, ok=not error, error=error)
        with self._lock:
            ready.finished += 1
            self._finish_room_if_done(ready)

    def _finish_room_if_done(self, ready: _ReadyRoom) -> None:
        """Close a room and let vLLM free its blocks once every write for it ended. Caller holds the lock."""
        if ready.complete and self._ready.get(ready.job.room) is ready:
            del self._ready[ready.job.room]
            if ready.submitted == 0:
                reason = f"prefill freed the KV after waiting {self.cfg.room_timeout_s:g} s for decode"
            else:
                reason = "KV of this room was already sent"
            self._close_room(ready.job.room, reason)
            self._finished_sending.add(ready.job.req_id)
            self._progress.set()

    def _reply(self, req: proto.TransferRequest, ok: bool, error: str = "") -> None:
        with self._lock:
            peer = self._peers.get(req.peer_id)
        if peer is None:
            logger.error("room=%d req=%s: cannot answer unknown peer %s", req.room, req.request_id, req.peer_id)
            return
        done = proto.TransferDone(
            room=req.room, request_id=req.request_id, tp_rank=self.spec.tp_rank, ok=ok, error=error
        )
        self._send_msg(peer.endpoint, done)

    def _close_room(self, room: int, reason: str) -> None:
        """Remember a room that will not (again) be sent. Caller holds the lock."""
        self._closed_rooms[room] = reason
        self._closed_rooms.move_to_end(room)
        while len(self._closed_rooms) > CLOSED_ROOMS_KEPT:
            self._closed_rooms.popitem(last=False)

    # ------------------------------------------------------------------ D side

    def _start_recv(self, job: RecvJob) -> None:
        try:
            route = self._route_with_retries(job)
            spec = self.spec
            problem = route_mismatch(
                route, job.bootstrap_addr, spec.block_size, spec.kv_dtype, spec.num_layers, spec.model
            )
            if problem is not None:
                raise LayoutError(problem)
            dp_rank = self._prefill_dp_rank(job, route)
            tp_ranks = decode_contacts(
                self.spec.heads,
                route.attn_tp_size,
                self.spec.tp_size,
                self.spec.tp_rank,
                is_mla=self.spec.use_mla,
                spread=job.room % route.attn_tp_size,
            )
            endpoints = []
            for tp in tp_ranks:
                info = route.rank(dp_rank, 0, tp)
                if info is None:
                    raise BootstrapError(f"prefill rank dp={dp_rank} tp={tp} is not registered at {job.bootstrap_addr}")
                endpoints.append(f"tcp://{info.rank_ip}:{info.rank_port}")
        except (BootstrapError, LayoutError) as exc:
            self._routes.invalidate(job.bootstrap_addr)
            self._fail_recv(job.req_id, str(exc))
            return
        except Exception as exc:  # noqa: BLE001
            logger.exception("room=%d req=%s: handshake error", job.room, job.req_id)
            self._fail_recv(job.req_id, f"internal error: {exc!r}")
            return
        request = proto.TransferRequest(
            room=job.room,
            request_id=job.req_id,
            peer_id=self.peer_id,
            dst_block_ids=list(job.dst_block_ids),
            start_block=job.start_block,
            endpoint=self.endpoint,
        )
        with self._lock:
            state = self._recvs.get(job.req_id)
            if state is None:  # already failed (timeout) while resolving
                return
            state.expected = len(endpoints)
            state.endpoints = endpoints
        for endpoint in endpoints:
            with self._hello_lock:  # the hello must leave before any request to that endpoint
                if endpoint not in self._hello_sent:
                    self._send_msg(endpoint, self._hello())
                    self._hello_sent.add(endpoint)
            self._send_msg(endpoint, request)
        logger.debug("room=%d req=%s: asked %s for %d blocks", job.room, job.req_id, endpoints, len(job.dst_block_ids))

    def _route_with_retries(self, job: RecvJob) -> proto.Route:
        """P's topology; a busy or still-starting prefill gets a few more tries within the KV wait."""
        deadline = time.monotonic() + min(self.cfg.kv_wait_timeout_s / 2, 30.0)
        while True:
            try:
                return self._routes.get(job.bootstrap_addr)
            except BootstrapBusy as exc:
                if time.monotonic() + 0.5 >= deadline:
                    raise
                logger.warning("room=%d req=%s: %s; retrying", job.room, job.req_id, exc)
                time.sleep(0.5)

    def _prefill_dp_rank(self, job: RecvJob, route: proto.Route) -> int:
        if job.prefill_dp_rank is not None:
            if job.prefill_dp_rank >= route.dp_size:
                raise BootstrapError(f"prefill_dp_rank {job.prefill_dp_rank} but prefill has dp_size {route.dp_size}")
            return job.prefill_dp_rank
        if route.dp_size == 1:
            return 0
        deadline = time.monotonic() + min(self.cfg.kv_wait_timeout_s, 30.0)
        while time.monotonic() < deadline:
            dp = self._routes.query_dp_rank(job.bootstrap_addr, job.room)
            if dp is not None:
                return dp
            time.sleep(0.05)
        raise BootstrapError(f"prefill never registered a dp rank for room {job.room}")

    def _hello(self) -> proto.PeerHello:
        return proto.PeerHello(
            peer_id=self.peer_id,
            session=self.engine.session,
            endpoint=self.endpoint,
            tp_rank=self.spec.tp_rank,
            tp_size=self.spec.tp_size,
            block_size=self.spec.block_size,
            kv_dtype=self.spec.kv_dtype,
            num_layers=self.spec.num_layers,
            regions=[r.as_tuple() for r in self.regions],
            total_kv_heads=self.spec.total_kv_heads,
            local_kv_heads=self.spec.local_kv_heads,
            use_mla=self.spec.use_mla,
            heads_outermost=self.spec.heads_outermost,
        )

    def _on_done(self, done: proto.TransferDone) -> None:
        if not done.ok:
            if "unknown decode peer" in done.error:
                with self._hello_lock:
                    self._hello_sent.clear()  # P restarted: introduce ourselves again next time
            self._fail_recv(done.request_id, f"prefill rank tp={done.tp_rank}: {done.error}", room=done.room)
            return
        with self._lock:
            state = self._recvs.get(done.request_id)
            if state is None or state.job.room != done.room:
                logger.warning("room=%d req=%s: late or unknown TransferDone ignored", done.room, done.request_id)
                return
            state.done.add(done.tp_rank)
            finished = len(state.done) >= state.expected > 0
            if not finished:
                return
            del self._recvs[done.request_id]
        self.stats.recvs_ok += 1
        logger.info("room=%d req=%s: KV received (%d blocks)", done.room, done.request_id, len(state.job.dst_block_ids))
        self._publish_recv(done.request_id)

    def _fail_recv(self, req_id: str, reason: str, room: int | None = None) -> None:
        with self._lock:
            state = self._recvs.pop(req_id, None)
            if state is None:
                return
        logger.error("room=%d req=%s: KV load failed: %s", state.job.room, req_id, reason)
        self.stats.recvs_failed += 1
        # Other P ranks must not write into blocks vLLM is about to reuse.
        for endpoint in state.endpoints:
            self._send_msg(endpoint, proto.TransferCancel(room=state.job.room, request_id=req_id))
        self._publish_recv(req_id, failed_blocks=list(state.job.dst_block_ids))

    def _publish_recv(self, req_id: str, failed_blocks: list[int] | None = None) -> None:
        """Hand a finished receive (failed: with its blocks) to vLLM's next take_finished().

        Callers log the outcome first, so its reason is in the log by the time the request ends.
        """
        with self._lock:
            if failed_blocks is not None:
                self._failed_recving[req_id] = failed_blocks
            self._finished_recving.add(req_id)
            self._progress.set()

    # ---------------------------------------------------------------- timeouts

    def _expire(self, now: float) -> None:
        stale_requests: list[_WaitingRequest] = []
        timed_out: list[_RecvState] = []
        with self._lock:
            for ready in list(self._ready.values()):
                if ready.deadline <= now and not ready.expired:
                    ready.expired = True  # accept no more requests; free once in-flight writes end
                    if ready.submitted < max(ready.expected, 1):
                        # Logged before the room can be freed, so the reason precedes vLLM seeing it.
                        self.stats.rooms_expired += 1
                        logger.warning(
                            "room=%d req=%s: no decode asked for this KV within %g s; freeing its blocks",
                            ready.job.room,
                            ready.job.req_id,
                            self.cfg.room_timeout_s,
                        )
                    self._finish_room_if_done(ready)
            for room, waiting in list(self._waiting.items()):
                due = [w for w in waiting if w.deadline <= now]
                if due:
                    stale_requests.extend(due)
                    waiting[:] = [w for w in waiting if w.deadline > now]
                    if not waiting:
                        del self._waiting[room]
            for state in list(self._recvs.values()):
                if state.deadline <= now:
                    timed_out.append(state)
        for waiting in stale_requests:
            error = waiting.closed_reason or f"prefill did not produce room {waiting.req.room} in time"
            self._reply(waiting.req, ok=False, error=error)
        for state in timed_out:
            self._routes.invalidate(state.job.bootstrap_addr)
            self._fail_recv(state.job.req_id, f"no KV from prefill within {self.cfg.kv_wait_timeout_s:g} s")

    # ------------------------------------------------------------------- ZMQ out

    def _send_msg(self, endpoint: str, msg: proto.Message) -> None:
        frame = proto.encode(msg)
        with self._push_lock:
            sock = self._push.get(endpoint)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 10_000)
                sock.connect(endpoint)
                self._push[endpoint] = sock
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                logger.error("ZMQ send queue to %s is full; %s dropped", endpoint, type(msg).__name__)
