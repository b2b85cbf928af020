"""P, ``transfer_mode: "layer"``: each layer's KV goes to D as soon as that layer is computed.

vLLM calls ``save_kv_layer`` after every attention layer of a forward pass (its
``maybe_transfer_kv_layer`` wrapper around the attention op, on the CPU backend too) and
``wait_for_save`` once the forward is done. The scheduler side says, per step, which blocks of
each P request with a room the step completes (``layer_chunks.LayerChunk``). A ``Stream`` (one per
room) records, per layer, how many of the room's blocks hold their final KV; each D request of
the room (a ``Reader``) has, per layer, how many of them were queued for writing to it. A layer
done -> every reader gets that layer's new blocks; a reader that comes late (D's request after
the prefill started, or ended) first gets everything already computed, so nothing is missed and
nothing is written twice. The writes run on writer threads bound to the rank's device (a layer's
write overlaps the next layers' compute), queued per D rank (``layer_writers.PeerWriters``): one D
rank's writes run in the order queued, one at a time, and a D whose writes stall holds only the
thread serving it, never another D's layers. When the final chunk's every layer is
written, the reader is done: ``TransferDone`` goes to D at once, without waiting for P's scheduler
to see the request finish.

Device ordering (``device_sync``): on an NPU/GPU ``save_kv_layer`` comes when the layer's KV
write is queued on the forward's stream, not done. ``on_layer`` (and ``on_forward_end``) record a
marker on that stream right then; the stream keeps it per layer and every write of that layer (also
a late reader's backlog) waits for it on its writer thread before the backend reads a byte.

The claims stay P's rooms' (``prefill_side.PrefillSide``, the ``StreamHost``): a stream takes D's
waiting requests from the room (``take_for_stream``; a reader is keyed by its ``rooms.ClaimKey``),
reports each one's end (``stream_done``) and the room is freed once the prefill finished and every
expected request was served, as in request mode. D requests that come after the scheduler reported
the prefill finished (``release``) are served by request mode's push. Models with several KV cache
groups and token-major KV with a staging buffer (nhd_reshuffle) stay on request mode.

Reader states (``ReaderState``): STREAMING (queued writes follow the layers) -> DONE (reported
OK) or STOPPED (cancelled by D, room aborted, a write failed: no new writes; writes still queued
skip the backend). Any answer to D waits until every write queued for the reader returned
(``Reader.pending`` at 0), so D never frees a block a write may still land in.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pd_connector import messages as proto
from pd_connector.layouts.regions import LayoutError, Region, block_runs
from pd_connector.layouts.tp import HeadSlice, plan_decode_rank, slices_from, tp_transfer_entries
from pd_connector.messages import DoneStatus
from pd_connector.scheduling.layer_chunks import LayerChunk
from pd_connector.transfer.backend import TransferBackend, TransferError
from pd_connector.transfer.context import RankContext, RankSpec
from pd_connector.transfer.device_sync import DONE, Marker
from pd_connector.transfer.layer_writers import MAX_LAYER_WRITERS, PeerWriters
from pd_connector.transfer.room_push import StreamResult
from pd_connector.transfer.rooms import ClaimKey

if TYPE_CHECKING:
    from pd_connector.transfer.prefill_side import PrefillSide

logger = logging.getLogger(__name__)

#: Streams kept at most (rooms whose prefill never reported finished are dropped oldest first).
MAX_STREAMS = 10_000


class ReaderState(enum.Enum):
    STREAMING = "streaming"
    STOPPED = "stopped"
    DONE = "done"


class StreamHost(Protocol):
    """What a stream needs from P's rooms (``prefill_side.PrefillSide``)."""

    def take_for_stream(self, room: int) -> list[proto.TransferRequest]:
        """D's requests waiting for ``room``'s prefill, now claimed by the stream."""
        ...

    def peer_of(self, peer_id: str) -> tuple[proto.PeerHello | None, str | None]:
        """(the decode peer's hello, why it cannot be served or None)."""
        ...

    def guard_of(self, peer: proto.PeerHello, req: proto.TransferRequest) -> tuple[Any, Any]:
        """(write guard, running checksum or None) of one push (``transfer.write_guard.guard_push``)."""
        ...

    def stream_done(self, p_req_id: str, done: StreamResult) -> None:
        """A reader ended: log it, answer D, count the claim served."""
        ...


@dataclass
class Stream:
    room: int
    req_id: str
    layer_end: list[int]  # per layer: blocks [0, n) hold their final KV (once layer_ready[layer] completed)
    layer_ready: list[Marker] = field(default_factory=list)  # per layer: device marker behind its KV writes
    block_ids: list[int] = field(default_factory=list)
    final_end: int | None = None  # blocks of the whole prompt, once the final chunk ran
    readers: dict[ClaimKey, Reader] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return self.final_end is not None and all(n >= self.final_end for n in self.layer_end)


@dataclass
class Reader:
    """One D rank's request for a streamed room."""

    req: proto.TransferRequest
    peer: proto.PeerHello
    stream: Stream
    slices: list[HeadSlice]
    sent: list[int]  # per layer: P blocks [0, n) queued for this reader
    guard: Any = None
    summed: Any = None
    state: ReaderState = ReaderState.STREAMING
    status: DoneStatus = DoneStatus.OK
    error: str = ""
    pending: int = 0  # writes queued or running; no answer to D before it is 0
    nbytes: int = 0
    entries: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def key(self) -> ClaimKey:
        return ClaimKey.of(self.req)

    def stop(self, status: DoneStatus, error: str) -> None:
        if self.state is ReaderState.STREAMING:
            self.state, self.status, self.error = ReaderState.STOPPED, status, error

    @property
    def finished(self) -> bool:
        """Nothing in flight, and either stopped or every layer of the whole prompt queued."""
        if self.pending or self.state is ReaderState.DONE:
            return False
        if self.state is ReaderState.STOPPED:
            return True
        end = self.stream.final_end
        return self.stream.complete and end is not None and all(n >= end for n in self.sent)


class LayerStreams:
    """A P rank's streams; called from the forward thread, the listener and the writer threads.

    ``writers``: threads writing layers at most (``layer_writers``), each serving one D rank at a time."""

    def __init__(
        self,
        ctx: RankContext,
        backend: TransferBackend,
        host: StreamHost,
        layer_regions: Mapping[str, range],
        writers: int = MAX_LAYER_WRITERS,
    ) -> None:
        self._ctx = ctx
        self._spec = ctx.spec
        self._backend = backend
        self._host = host
        self._layers = list(layer_regions)
        self._layer_index = {name: i for i, name in enumerate(self._layers)}
        self._regions = [list(ctx.regions[r.start : r.stop]) for r in layer_regions.values()]
        self._region_ranges = list(layer_regions.values())
        self._lock = threading.Lock()
        self._streams: OrderedDict[int, Stream] = OrderedDict()
        self._readers: dict[tuple[int, ClaimKey], Reader] = {}
        self._step: object | None = None  # the metadata of the step being run
        self._device = ctx.device
        self._writers = PeerWriters(writers, initializer=self._device.bind_thread)

    # ------------------------------------------------------------ forward thread

    def on_layer(self, chunks: Sequence[LayerChunk], step: object, layer_name: str) -> None:
        """vLLM's save_kv_layer: ``layer_name``'s KV writes of this step's chunks are queued on the
        device's current stream (a marker recorded now completes once they ran)."""
        layer = self._layer_index.get(layer_name)
        if layer is None or not chunks:
            return
        ready = self._device.record()
        with self._lock:
            ends = self._begin_step(chunks, step)
            for stream in self._step_streams(chunks):
                stream.layer_end[layer] = ends[stream.room]
                stream.layer_ready[layer] = ready
                for reader in list(stream.readers.values()):
                    self._queue(reader, layer)
            finished = self._take_finished()
        self._report(finished)

    def on_forward_end(self, chunks: Sequence[LayerChunk], step: object) -> None:
        """vLLM's wait_for_save: the whole forward is queued; layers save_kv_layer was not called for
        follow a marker recorded now."""
        if not chunks:
            return
        ready = self._device.record()
        with self._lock:
            ends = self._begin_step(chunks, step)
            for stream in self._step_streams(chunks):
                for layer in range(len(self._layers)):
                    if stream.layer_end[layer] < ends[stream.room]:
                        stream.layer_end[layer] = ends[stream.room]
                        stream.layer_ready[layer] = ready
                        for reader in list(stream.readers.values()):
                            self._queue(reader, layer)
            finished = self._take_finished()
        self._report(finished)

    # --------------------------------------------------------- from P's rooms

    def offer(self, room: int) -> None:
        """A D request for ``room`` is waiting for the prefill: a running stream takes it."""
        with self._lock:
            stream = self._streams.get(room)
            if stream is not None:
                self._adopt(stream)
            finished = self._take_finished()
        self._report(finished)

    def stop(self, room: int, key: ClaimKey, status: DoneStatus, error: str) -> bool:
        """D gave up one request (claim ``key``): no new writes; answered once in-flight ones ended."""
        with self._lock:
            reader = self._readers.get((room, key))
            if reader is not None:
                reader.stop(status, error)
            finished = self._take_finished()
        self._report(finished)
        return reader is not None

    def abort(self, room: int) -> None:
        """The room's prefill was aborted: its readers stop (ABORTED) and the stream goes."""
        with self._lock:
            stream = self._streams.pop(room, None)
            for reader in stream.readers.values() if stream is not None else ():
                reader.stop(DoneStatus.ABORTED, "prefill request was aborted")
            finished = self._take_finished()
        self._report(finished)

    def release(self, room: int) -> None:
        """P's scheduler reported the prefill finished: later D requests go through request mode."""
        with self._lock:
            self._streams.pop(room, None)

    def close(self) -> None:
        self._writers.close()

    # ----------------------------------------------------------------- inside

    def _begin_step(self, chunks: Sequence[LayerChunk], step: object) -> dict[int, int]:
        """First call of a step: streams follow its chunks (new rooms take D's waiting requests)."""
        if step is not self._step:
            self._step = step
            for chunk in chunks:
                stream = self._streams.get(chunk.room)
                if stream is None or stream.req_id != chunk.req_id:
                    stream = Stream(chunk.room, chunk.req_id, [0] * len(self._layers), [DONE] * len(self._layers))
                    self._streams[chunk.room] = stream
                    while len(self._streams) > MAX_STREAMS:
                        self._streams.popitem(last=False)
                elif chunk.start == 0:  # rescheduled after a preemption: new blocks, everything again
                    stream.layer_end = [0] * len(self._layers)
                    for reader in stream.readers.values():
                        reader.sent = [0] * len(self._layers)
                        reader.nbytes = reader.entries = 0
                        if reader.summed is not None:
                            reader.summed.value = 0
                stream.block_ids = list(chunk.block_ids)
                stream.final_end = chunk.end if chunk.final else None
                self._adopt(stream)
        return {chunk.room: chunk.end for chunk in chunks}

    def _step_streams(self, chunks: Sequence[LayerChunk]) -> list[Stream]:
        out = []
        for chunk in chunks:
            stream = self._streams.get(chunk.room)
            if stream is not None and stream.req_id == chunk.req_id:
                out.append(stream)
        return out

    def _adopt(self, stream: Stream) -> None:
        """Take the room's waiting D requests; each first gets every block already computed."""
        for req in self._host.take_for_stream(stream.room):
            reader = self._reader(stream, req)
            stream.readers[reader.key] = reader
            self._readers[(stream.room, reader.key)] = reader
            self._ctx.traces.get(stream.room, stream.room, stream.req_id).mark_first("push_started")
            for layer in range(len(self._layers)):
                self._queue(reader, layer)

    def _reader(self, stream: Stream, req: proto.TransferRequest) -> Reader:
        peer, problem = self._host.peer_of(req.peer_id)
        if peer is None:
            reader = Reader(req, _NO_PEER, stream, [], [0] * len(self._layers))
            reader.stop(DoneStatus.UNKNOWN_PEER, f"unknown decode peer {req.peer_id} (no PeerHello received)")
            return reader
        reader = Reader(req, peer, stream, [], [0] * len(self._layers))
        if problem:
            reader.stop(DoneStatus.INCOMPATIBLE, problem)
            return reader
        try:
            reader.guard, reader.summed = self._host.guard_of(peer, req)
            plan = plan_decode_rank(
                self._spec.heads,
                self._spec.tp_size,
                peer.tp_size,
                peer.tp_rank,
                is_mla=self._spec.use_mla,
                spread=req.room % self._spec.tp_size,
            )
            reader.slices = slices_from(plan, self._spec.tp_rank)
        except LayoutError as exc:
            reader.stop(DoneStatus.BAD_REQUEST if "block" in str(exc) else DoneStatus.INCOMPATIBLE, str(exc))
        return reader

    def _queue(self, reader: Reader, layer: int) -> None:
        """Queue the write of ``layer``'s newly computed blocks to ``reader``. Caller holds the lock."""
        stream = reader.stream
        end = stream.layer_end[layer]
        if reader.state is not ReaderState.STREAMING or end <= reader.sent[layer]:
            return
        req = reader.req
        first, count = req.start_block, len(req.dst_block_ids)
        if stream.final_end is not None and first + count > stream.final_end:
            reader.stop(
                DoneStatus.BAD_REQUEST,
                f"decode asks for blocks {first}..{first + count - 1} but the prefill holds {stream.final_end} blocks",
            )
            return
        lo, hi = max(reader.sent[layer], first), min(end, first + count)
        reader.sent[layer] = end
        if hi <= lo or not reader.slices:
            return
        try:
            runs = block_runs(stream.block_ids[lo:hi], req.dst_block_ids[lo - first : hi - first])
            peer_regions = [
                Region(*r)
                for r in reader.peer.regions[self._region_ranges[layer].start : self._region_ranges[layer].stop]
            ]
            src, dst, lengths = tp_transfer_entries(
                self._regions[layer],
                peer_regions,
                reader.slices,
                self._spec.local_kv_heads,
                reader.peer.local_kv_heads,
                runs,
            )
            if reader.guard is not None:
                reader.guard.check(dst, lengths)
        except LayoutError as exc:
            reader.stop(DoneStatus.BAD_REQUEST, str(exc))
            return
        reader.pending += 1
        ready = stream.layer_ready[layer]
        self._writers.submit(reader.peer.transfer_descriptor, lambda: self._write(reader, ready, src, dst, lengths))

    def _write(self, reader: Reader, ready: Marker, src: list[int], dst: list[int], lengths: list[int]) -> None:
        """Writer thread of the reader's D rank: one layer's blocks to it, once the device wrote them (``ready``)."""
        error = ""
        wanted: Callable[[], bool] = lambda: reader.state is ReaderState.STREAMING  # noqa: E731
        skipped = not wanted()  # the reader stopped while this write was queued: nothing to move
        try:
            if not skipped:
                ready.wait()
                self._backend.write(
                    reader.peer.transfer_descriptor, src, dst, lengths, self._ctx.cfg.max_batch_entries, wanted
                )
                if reader.summed is not None:
                    reader.summed.add(src, dst, lengths)
        except TransferError as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - reported to D, never lost
            logger.exception("room=%d req=%s: layer write failed", reader.req.room, reader.req.request_id)
            error = f"internal error: {exc!r}"
        with self._lock:
            reader.pending -= 1
            if error:
                reader.stop(DoneStatus.TRANSFER_FAILED, error)
            elif not skipped:
                reader.nbytes += sum(lengths)
                reader.entries += len(lengths)
            finished = self._take_finished()
        self._report(finished)

    def _take_finished(self) -> list[Reader]:
        """Readers that just ended (marked DONE, out of the table). Caller holds the lock."""
        out = [r for r in self._readers.values() if r.finished]
        for reader in out:
            reader.state = ReaderState.DONE  # its status says how it ended
            del self._readers[(reader.stream.room, reader.key)]
            reader.stream.readers.pop(reader.key, None)
        return out

    def _report(self, readers: list[Reader]) -> None:
        for r in readers:
            ok = r.status is DoneStatus.OK
            result = StreamResult(
                r.req,
                r.status,
                r.error,
                r.nbytes if ok else -1,
                r.entries,
                time.perf_counter() - r.started,
                r.summed.value if ok and r.summed is not None else None,
            )
            self._host.stream_done(r.stream.req_id, result)


_NO_PEER = proto.PeerHello(
    peer_id="?", transfer_descriptor=b"", endpoint="", tp_rank=0, tp_size=1, block_size=0, kv_dtype="", num_layers=0,
    regions=[],
)  # fmt: skip


def layer_regions_of(kv_caches: Mapping[str, Any], region_counts: Sequence[int]) -> dict[str, range]:
    """Each layer's slice of the region table (``layout.regions_of_kv_caches`` order: layer, then part)."""
    out, start = {}, 0
    for name, count in zip(kv_caches, region_counts, strict=True):
        out[name] = range(start, start + count)
        start += count
    return out


def layer_push_refusal(spec: RankSpec, has_reshuffle: bool) -> str | None:
    """Why this rank cannot stream layers (it then pushes whole requests), or None."""
    if len(set(spec.region_groups)) > 1:
        return "the model has several KV cache groups (hybrid KV cache manager)"
    if has_reshuffle:
        return "token-major KV with a staging buffer (mixed TP via nhd_reshuffle)"
    return None


def enable_layer_push(
    prefill: PrefillSide, spec: RankSpec, has_reshuffle: bool, kv_caches: Mapping[str, Any], num_blocks: int
) -> LayerStreams | None:
    """P worker, transfer_mode "layer": ``prefill``'s LayerStreams, or None (logged) where
    it pushes whole requests (``has_reshuffle``: its KV goes through a staging buffer, nhd_reshuffle)."""
    from pd_connector.layouts.regions import regions_of_kv_caches

    refusal = layer_push_refusal(spec, has_reshuffle)
    if refusal is not None:
        logger.warning("transfer_mode 'layer' is not available here (%s): KV is pushed per request", refusal)
        return None
    counts = [len(regions_of_kv_caches({name: value}, num_blocks)) for name, value in kv_caches.items()]
    logger.info(
        "transfer_mode 'layer': each of the %d layers' KV is written to decode as soon as it is computed", len(counts)
    )
    return prefill.enable_layer_push(layer_regions_of(kv_caches, counts))
