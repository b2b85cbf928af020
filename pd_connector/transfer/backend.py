"""TransferBackend: the seam between the transfer manager and whatever moves the bytes.

A backend is opened for one worker rank (see ``registry``), registers that rank's KV memory,
and writes local byte ranges into a peer's registered memory. Peers find each other through
``descriptor``: opaque bytes the backend hands out, carried to the other side in the ZMQ
handshake (``PeerHello.transfer_descriptor``) and given back to ``write``. The manager never
looks inside a descriptor.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

logger = logging.getLogger(__name__)

#: Extra tries of a failed batch write (the same bytes to the same places, so a repeat is harmless).
WRITE_RETRIES = 1


def batch_budget_s(stall_s: float, retries: int = WRITE_RETRIES) -> float:
    """The longest one batch, its retries included, may be in flight: ``(1 + retries) * stall_s``.

    ``stall_s`` is the active transport's bound on one batch write (``BackendOptions.batch_stall_s``).
    P starts no retry that could end past this budget (``write_in_batches``); D keeps a stopped load's
    blocks for this budget plus what P's view of D can lag (``loads.stop_wait_s``)."""
    return (1 + retries) * stall_s


def overrun_tolerance_s(stall_s: float) -> float:
    """How far past ``stall_s`` an attempt may end and still count as within it: a transport fails a
    batch at its timeout, and returning takes a moment. Smaller than D's stop-wait margin."""
    return min(0.05 * stall_s, 1.0)


#: Byte addresses or lengths of write entries.
Ints = Sequence[int]
#: Asked before every batch and retry: False once the reader gave up (its blocks may belong to someone else soon).
Wanted = Callable[[], bool] | None


class TransferError(RuntimeError):
    """A backend call failed (the write did not, or not entirely, land)."""


class WriteStopped(TransferError):
    """The reader gave up (``still_wanted()`` said False): the write stopped between two batches."""


@runtime_checkable
class TransferBackend(Protocol):
    """One rank's data plane: register local KV memory, write into a peer's."""

    @property
    def descriptor(self) -> bytes:
        """What a peer passes to its own ``write`` to reach this rank's registered memory."""
        ...

    def register(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Make (addr, length) ranges of this process readable and writable by peers."""
        ...

    def write(
        self, peer_descriptor: bytes, src: Ints, dst: Ints, lengths: Ints, max_batch: int, still_wanted: Wanted = None
    ) -> None:
        """Write local src[i] to the peer's dst[i] (lengths[i] bytes), at most max_batch entries a call.

        Raises TransferError. ``still_wanted``, when given, is asked before every batch and retry: a
        write for a reader that gave up stops there (WriteStopped), since its blocks may be reused.
        """
        ...

    def close(self) -> None:
        """Unregister the memory and release the backend (idempotent)."""
        ...


def describe(descriptor: bytes) -> str:
    """A descriptor as a log-friendly string: its text when printable ASCII, else hex."""
    try:
        text = descriptor.decode("ascii")
    except UnicodeDecodeError:
        return descriptor.hex()
    return text if text.isprintable() else descriptor.hex()


BatchWrite = Callable[[list[int], list[int], list[int]], int]
Batch = tuple[list[int], list[int], list[int]]

#: Batches one write keeps in flight at most (``write_pipelined``): the next is handed to the transport
#: while earlier ones still move, so the wire does not idle between two batches.
PIPELINE_DEPTH = 4
#: Bytes one write keeps in flight at most (a batch larger than this goes alone). It bounds how long a
#: batch may wait behind the ones submitted before it, which its transport's bound (``batch_stall_s``,
#: counted from its submission) must cover as well: 1 GiB is 1 s at 1 GB/s.
PIPELINE_BYTES = 1 << 30


class BatchPipe(Protocol):
    """A transport's asynchronous batch write, as ``write_pipelined`` drives it."""

    def submit(self, src: list[int], dst: list[int], lengths: list[int]) -> Any:
        """Start writing one batch; returns the handle ``wait`` takes (never raises for a failed batch)."""
        ...

    def wait(self, handle: Any) -> int:
        """Block until the batch of ``handle`` ended: 0 when every byte landed, else the transport's error.

        It returns within the transport's bound on one batch (``batch_stall_s``) counted from ``submit``."""
        ...

    # Optional, for a transport with a queue per peer: ``ready(entries) -> bool``, whether a batch of that
    # many entries fits now (when not, ``write_pipelined`` first waits for its own oldest batch);
    # ``reserve(entries)``, taking room for one (waiting until it fits), asked before the reader is asked
    # and before every ``submit``, which then owns the room (given back when its batch ended); and
    # ``release(entries)``, giving back a reservation no batch was submitted for.


class SyncPipe:
    """A synchronous ``write_batch(src, dst, lengths) -> status`` as a pipe: the batch ends in ``submit``."""

    def __init__(self, write_batch: BatchWrite) -> None:
        self._write_batch = write_batch

    def submit(self, src: list[int], dst: list[int], lengths: list[int]) -> int:
        return int(self._write_batch(src, dst, lengths))

    def wait(self, handle: int) -> int:
        return handle


def write_in_batches(
    write_batch: BatchWrite,
    src: Ints,
    dst: Ints,
    lengths: Ints,
    max_batch: int,
    still_wanted: Wanted,
    *,
    what: str,
    peer: str,
    retries: int = WRITE_RETRIES,
    stall_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Call ``write_batch(src, dst, lengths) -> status`` (0: ok) per batch of at most max_batch entries,
    one batch after the other: ``write_pipelined`` with one batch in flight (its docstring has the rules)."""
    write_pipelined(
        SyncPipe(write_batch),
        src,
        dst,
        lengths,
        max_batch,
        still_wanted,
        what=what,
        peer=peer,
        depth=1,
        retries=retries,
        stall_s=stall_s,
        clock=clock,
    )


@dataclass
class _InFlight:
    """One submitted batch: its entries, its first byte index, when its first try started, its handle."""

    first: int
    batch: Batch
    nbytes: int
    began: float
    handle: Any


def write_pipelined(
    pipe: BatchPipe,
    src: Ints,
    dst: Ints,
    lengths: Ints,
    max_batch: int,
    still_wanted: Wanted,
    *,
    what: str,
    peer: str,
    depth: int = PIPELINE_DEPTH,
    max_bytes: int = PIPELINE_BYTES,
    retries: int = WRITE_RETRIES,
    stall_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Write the entries in batches of at most max_batch through ``pipe``, up to ``depth`` batches (and
    ``max_bytes``, unless one batch is larger; and what ``pipe.ready`` allows) in flight; returns once
    every batch landed. When a batch failed, the others in flight end before it is tried again.

    ``still_wanted()`` is asked before every batch is submitted: once the reader gave up, no further
    batch starts (WriteStopped), so at most the batches in flight land after a cancel; D keeps the
    blocks until P answered, i.e. until this returned or raised, and it never returns or raises while a
    batch is in flight (it waits for every submitted one first). A failed batch is written again up to
    ``retries`` times unless the reader gave up; a batch that still fails raises TransferError. ``what``
    and ``peer`` name the write in messages ("Mooncake batch write of 12 entries to 10.0.0.3:15000
    failed with -1").

    ``stall_s`` (the transport's bound on one batch write, ``BackendOptions.batch_stall_s``, counted from
    the batch's submission) is P's half of the timing contract: a batch and its retries end within
    ``batch_budget_s(stall_s, retries)`` of the batch's start: retry k starts only if the k tries before
    it stayed within k * ``stall_s`` (give or take ``overrun_tolerance_s``), so it too ends within the
    budget (TransferError otherwise); without ``stall_s`` nothing is timed. A batch starts only while
    the reader wants it, and P learns that D gave up within peer_timeout_s (its cancel, or liveness), so
    every byte lands within budget + peer_timeout_s of D giving up: D's stop wait (``loads.stop_wait_s``)
    is that plus a margin. An attempt that outlasted ``stall_s`` broke the transport's bound; it is
    logged with the bound.
    """
    if depth < 1:
        raise ValueError(f"{what}: pipeline depth must be >= 1, got {depth}")
    total = len(src)
    flying: deque[_InFlight] = deque()
    ready = getattr(pipe, "ready", None)

    def settle_oldest() -> None:
        job = flying.popleft()
        ret = _ended(pipe, job.handle, job.began, len(job.batch[0]), stall_s, clock, what, peer)
        if ret == 0:
            return
        # A batch failed: the others in flight end first, so its retries (one try at a time) run alone.
        failed = [(job, ret)]
        while flying:
            other = flying.popleft()
            status = _ended(pipe, other.handle, other.began, len(other.batch[0]), stall_s, clock, what, peer)
            if status != 0:
                failed.append((other, status))
        for job, ret in failed:
            _retry(pipe, job, ret, still_wanted, retries, stall_s, clock, what, peer)

    try:
        for first in range(0, total, max_batch):
            end = first + max_batch
            batch = (list(src[first:end]), list(dst[first:end]), list(lengths[first:end]))
            nbytes = sum(batch[2])
            while flying and (
                len(flying) >= depth
                or sum(f.nbytes for f in flying) + nbytes > max_bytes
                or (ready is not None and not ready(len(batch[0])))
            ):
                settle_oldest()
            undo = _reserve(pipe, len(batch[0]))  # may wait for other writes' batches: ask the reader after it
            if still_wanted is not None and not _wanted(still_wanted, undo):
                raise WriteStopped(f"{what} to {peer} stopped after {first} of {total} entries: the reader gave up")
            began = clock()
            flying.append(_InFlight(first, batch, nbytes, began, pipe.submit(*batch)))  # it owns the reservation
        while flying:
            settle_oldest()
    finally:
        # Raising with batches in flight (a failed batch, the reader gone): wait for each to end first,
        # so no byte of this write lands after the caller answered D.
        while flying:
            left = flying.popleft()
            try:
                pipe.wait(left.handle)
            except Exception:  # noqa: BLE001 - the first error is the one raised
                logger.exception("%s to %s: waiting for a batch in flight failed", what, peer)


def _retry(
    pipe: BatchPipe,
    job: _InFlight,
    ret: int,
    still_wanted: Wanted,
    retries: int,
    stall_s: float | None,
    clock: Callable[[], float],
    what: str,
    peer: str,
) -> None:
    """A failed batch (status ``ret``) tried again, one try at a time, while within its budget."""
    for attempt in range(retries):
        if ret == 0:
            break
        undo = _reserve(pipe, len(job.batch[0]))
        if still_wanted is not None and not _wanted(still_wanted, undo):
            break
        elapsed = clock() - job.began
        if stall_s is not None and elapsed > (attempt + 1) * stall_s + overrun_tolerance_s(stall_s):
            undo()
            budget = batch_budget_s(stall_s, retries)
            raise TransferError(
                f"{what} of {len(job.batch[0])} entries to {peer} failed with {ret} after {elapsed:.1f} s; not tried "
                f"again: a retry could end past the batch's {budget:g} s budget ({1 + retries} x the transport's "
                f"{stall_s:g} s batch bound, batch_stall_s) that the reader's wait counts on"
            )
        logger.warning(
            "%s of %d entries to %s failed with %d; trying again (%d/%d)",
            what,
            len(job.batch[0]),
            peer,
            ret,
            attempt + 1,
            retries,
        )
        t0 = clock()
        ret = _ended(pipe, pipe.submit(*job.batch), t0, len(job.batch[0]), stall_s, clock, what, peer)
    if ret != 0:
        raise TransferError(f"{what} of {len(job.batch[0])} entries to {peer} failed with {ret}")


def _reserve(pipe: BatchPipe, entries: int) -> Callable[[], None]:
    """Room for a batch of ``entries`` in a pipe with a queue (``reserve``, waiting until it fits); returns
    what gives the room back when no batch is submitted after all."""
    reserve = getattr(pipe, "reserve", None)
    if reserve is None:
        return lambda: None
    reserve(entries)
    return lambda: pipe.release(entries)  # type: ignore[attr-defined]


def _wanted(still_wanted: Callable[[], bool], undo: Callable[[], None]) -> bool:
    """``still_wanted()``; when False (or raising), the reservation ``undo`` gives back goes back."""
    try:
        wanted = still_wanted()
    except BaseException:
        undo()
        raise
    if not wanted:
        undo()
    return wanted


def _ended(
    pipe: BatchPipe,
    handle: Any,
    t0: float,
    entries: int,
    stall_s: float | None,
    clock: Callable[[], float],
    what: str,
    peer: str,
) -> int:
    """The status of one try (submitted at ``t0``); a try longer than the transport's bound is logged."""
    ret = int(pipe.wait(handle))
    took = clock() - t0
    if stall_s is not None and took > stall_s + overrun_tolerance_s(stall_s):
        logger.error(
            "%s of %d entries to %s took %.1f s, past the transport's %g s batch bound (batch_stall_s, from its "
            "timeout settings, see Timeouts in docs/configuration.md): D's stop wait counts on that bound, so a "
            "reader that gave up meanwhile may already have reused the blocks",
            what,
            entries,
            peer,
            took,
            stall_s,
        )
    return ret
