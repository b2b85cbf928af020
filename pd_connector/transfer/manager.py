"""KVTransferManager: one per worker rank; what the worker calls each step.

It wires the pieces together: the ZMQ ``Channel`` (sockets and listener), the ``TaskPool``
(backend writes, handshakes), the ``Outbox`` (finished requests for vLLM), ``TransferStats``,
and the side this rank plays: ``PrefillSide`` (rooms and pushes) on P, ``DecodeSide`` (loads)
on D; a kv_both rank has both (each request uses the one its kv_transfer_params name), and so has a D
with ``migration`` (its aborted requests' KV is held as rooms other decoders load:
pd_connector.scheduling.migration). The transfer backend is the caller's: it opens it, registers the KV memory and closes it
after ``close()``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from pd_connector import messages as proto
from pd_connector.auth import token_of
from pd_connector.bootstrap.exposure import exposure_of
from pd_connector.config import DisaggConfig
from pd_connector.layouts.regions import Region
from pd_connector.metadata import RecvJob, SendJob
from pd_connector.trace import TraceBook, make_tracer
from pd_connector.transfer.backend import TransferBackend
from pd_connector.transfer.channel import Channel
from pd_connector.transfer.context import RankContext, RankSpec
from pd_connector.transfer.decode_side import DecodeSide
from pd_connector.transfer.device_sync import NO_DEVICE, DeviceSync
from pd_connector.transfer.liveness import PeerWatch
from pd_connector.transfer.nhd_reshuffle import NhdReshuffle
from pd_connector.transfer.outbox import Outbox
from pd_connector.transfer.prefill_side import PrefillSide
from pd_connector.transfer.stats import TransferStats
from pd_connector.transfer.tasks import TaskPool

__all__ = ["KVTransferManager", "RankSpec"]

logger = logging.getLogger(__name__)


class KVTransferManager:
    def __init__(
        self,
        cfg: DisaggConfig,
        spec: RankSpec,
        regions: Sequence[Region],
        backend: TransferBackend,
        otlp_traces_endpoint: str | None = None,
        reshuffle: NhdReshuffle | None = None,
        device: DeviceSync = NO_DEVICE,
    ) -> None:
        """``device``: the KV's device (``device_sync.for_kv_caches``): the transfer threads bind it, pushes
        wait for its events; the default is CPU (no ordering needed)."""
        exposure = exposure_of(cfg)  # refuses a non-loopback control plane without a token (ConfigError)
        self.cfg = cfg
        self.spec = spec
        self.regions = list(regions)
        stage = f"pp{spec.pp_rank}" if spec.pp_size > 1 else ""
        self.stats = TransferStats(f"dp{spec.dp_rank}tp{spec.tp_rank}{stage}")
        lead = spec.tp_rank == 0 and spec.pp_rank == 0  # one rank of the instance logs its phase traces
        self.traces = TraceBook(cfg.mode, make_tracer(otlp_traces_endpoint) if lead else None, enabled=lead)
        self.outbox = Outbox()
        self.device = device
        watch = PeerWatch(cfg.peer_timeout_s)  # heartbeats with the peers of pending work (transfer.liveness)
        # A port from kv_port (RankSpec.zmq_port) or a random one; bound before any thread starts.
        origin = f"{spec.zmq_port_origin}, rank dp{spec.dp_rank}/tp{spec.tp_rank}/pp{spec.pp_rank}"
        self.channel = Channel(
            cfg.local_ip, self.stats, self._on_message, self._on_tick, token_of(cfg), watch, spec.zmq_port, origin
        )
        self.pool = TaskPool(cfg.transfer_threads, initializer=device.bind_thread)  # threads on the rank's device
        self.endpoint = self.channel.endpoint
        self.rank_port = self.channel.port
        self.peer_id = f"{cfg.local_ip}:{self.rank_port}/dp{spec.dp_rank}/tp{spec.tp_rank}"
        ctx = RankContext(
            cfg, spec, self.regions, self.channel.send, self.pool.submit, self.stats, self.outbox, self.traces
        )
        ctx = dataclasses.replace(ctx, reshuffle=reshuffle, device=device)
        if reshuffle is not None:
            reshuffle.device = device
        self.prefill = PrefillSide(ctx, backend) if cfg.pushes_kv else None
        self.decode = DecodeSide(ctx, backend.descriptor, self.peer_id, self.endpoint) if cfg.is_decode else None
        self.channel.start()
        from_kv_port = f" (from {origin})" if spec.kv_port is not None else ""
        logger.info(
            "KV transfer manager (%s) listening on %s%s, peer %s", cfg.mode, self.endpoint, from_kv_port, self.peer_id
        )
        if spec.tp_rank == 0:
            logger.log(logging.WARNING if exposure.open else logging.INFO, "%s", exposure.line)

    # ------------------------------------------------------------ public API

    def add_sends(self, jobs: Sequence[SendJob]) -> None:
        """P (and D with migration: an aborted request's KV), on the forward's thread (start_load_kv): these
        rooms finished prefill; send each as soon as its D ranks ask, once the device ran the forward that
        wrote their KV (a marker recorded now on the forward's stream follows every forward queued before it,
        that prefill's included)."""
        prefill = self._prefill("add_sends")
        prefill.add_sends(jobs, self.device.record() if jobs else None)

    def drop_rooms(self, rooms: Sequence[int]) -> None:
        """P: these rooms will never have KV (request aborted); tell their D if it asks."""
        self._prefill("drop_rooms").drop_rooms(rooms)

    def add_recvs(self, jobs: Sequence[RecvJob]) -> None:
        """D: start fetching these requests' KV (handshake runs off the step loop)."""
        self._decode("add_recvs").add_recvs(jobs)

    def take_finished(self) -> tuple[set[str], set[str], dict[str, list[int]]]:
        """(finished_sending, finished_recving incl. failed, failed -> their dst blocks)."""
        return self.outbox.take()

    def mark_scheduled(self, scheduled: dict[str, float]) -> None:
        """D: these requests were scheduled after their KV arrived (ends their phase traces)."""
        if self.decode is not None:
            for req_id, at in scheduled.items():
                self.decode.on_scheduled(req_id, at)

    def take_stats(self) -> dict | None:
        """What happened since the previous call, for vLLM's stats path (None if nothing)."""
        gauges = {}
        if self.prefill is not None:
            gauges["rooms_held"] = self.prefill.rooms_held()
        if self.decode is not None:
            gauges["loads_waiting"] = self.decode.loads_waiting()
        return self.stats.take_interval(gauges)

    def wait_for_progress(self, timeout: float) -> None:
        """Block up to `timeout` s, less if a transfer finishes meanwhile (idle engine steps)."""
        self.outbox.wait(timeout)

    def close(self) -> None:
        if self.prefill is not None:
            self.prefill.shutdown()  # D ranks waiting on this rank's rooms fail at once
        self.channel.stop()
        self.pool.shutdown(wait=False)
        self.channel.close()

    # -------------------------------------------------------------- wiring

    def _prefill(self, what: str) -> PrefillSide:
        if self.prefill is None:
            raise RuntimeError(
                f"{what} on a {self.cfg.mode} rank: only prefill and kv_both ranks (and migration decode) send KV"
            )
        return self.prefill

    def _decode(self, what: str) -> DecodeSide:
        if self.decode is None:
            raise RuntimeError(f"{what} on a {self.cfg.mode} rank: only decode and kv_both ranks load KV")
        return self.decode

    def _on_message(self, msg: proto.Message) -> None:
        """Listener thread: route one message to the side that handles it."""
        if isinstance(msg, proto.TransferDone):
            if self.decode is not None:
                self.decode.on_done(msg)
            else:
                logger.warning("room=%d req=%s: prefill rank got a TransferDone; ignored", msg.room, msg.request_id)
            return
        if self.prefill is None:
            sender = msg.peer_id if isinstance(msg, proto.PeerHello) else f"room={msg.room} req={msg.request_id}"
            logger.warning("decode rank got a %s (%s); ignored", type(msg).__name__, sender)
        elif isinstance(msg, proto.PeerHello):
            self.prefill.on_hello(msg)
        elif isinstance(msg, proto.TransferRequest):
            self.prefill.on_transfer_request(msg)
        elif isinstance(msg, proto.TransferCancel):
            self.prefill.on_cancel(msg)

    def _on_tick(self, now: float) -> None:
        busy = self.prefill.peers_waited_on() if self.prefill is not None else set()
        if self.decode is not None:
            busy |= self.decode.peers_waited_on()
        for lost in self.channel.beat(now, busy):
            if self.prefill is not None:
                self.prefill.peer_lost(lost.endpoint, lost.silent_s)
            if self.decode is not None:
                self.decode.peer_lost(lost.endpoint, lost.silent_s)
        if self.prefill is not None:
            self.prefill.expire(now)
        if self.decode is not None:
            self.decode.expire(now)
