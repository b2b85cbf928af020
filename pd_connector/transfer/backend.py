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
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

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
    """Call ``write_batch(src, dst, lengths) -> status`` (0: ok) per batch of at most max_batch entries.

    ``still_wanted()`` is asked before every batch: once the reader gave up, no further batch starts
    (WriteStopped), so at most the batch in flight lands after a cancel; D keeps the blocks until P
    answered, i.e. until this returned or raised. A failed batch is written again up to ``retries``
    times unless the reader gave up; a batch that still fails raises TransferError. ``what`` and ``peer`` name the
    write in messages ("Mooncake batch write of 12 entries to 10.0.0.3:15000 failed with -1").

    ``stall_s`` (the transport's bound on one batch write, ``BackendOptions.batch_stall_s``) is P's half
    of the timing contract: a batch and its retries end within ``batch_budget_s(stall_s, retries)`` of
    the batch's start: retry k starts only if the k tries before it stayed within k * ``stall_s`` (give
    or take ``overrun_tolerance_s``), so it too ends within the budget (TransferError otherwise); without
    ``stall_s`` nothing is timed. A batch starts only while the reader wants it, and P learns that D gave
    up within peer_timeout_s (its cancel, or liveness), so every byte lands within budget +
    peer_timeout_s of D giving up: D's stop wait (``loads.stop_wait_s``) is that plus a margin. An
    attempt that outlasted ``stall_s`` broke the transport's bound; it is logged with the bound.
    """
    for start in range(0, len(src), max_batch):
        if still_wanted is not None and not still_wanted():
            raise WriteStopped(f"{what} to {peer} stopped after {start} of {len(src)} entries: the reader gave up")
        end = start + max_batch
        batch = (list(src[start:end]), list(dst[start:end]), list(lengths[start:end]))
        began = clock()
        ret = _attempt(write_batch, batch, stall_s, clock, what, peer)
        for attempt in range(retries):
            if ret == 0 or (still_wanted is not None and not still_wanted()):
                break
            elapsed = clock() - began
            if stall_s is not None and elapsed > (attempt + 1) * stall_s + overrun_tolerance_s(stall_s):
                budget = batch_budget_s(stall_s, retries)
                raise TransferError(
                    f"{what} of {len(batch[0])} entries to {peer} failed with {ret} after {elapsed:.1f} s; not tried "
                    f"again: a retry could end past the batch's {budget:g} s budget ({1 + retries} x the transport's "
                    f"{stall_s:g} s batch bound, batch_stall_s) that the reader's wait counts on"
                )
            logger.warning(
                "%s of %d entries to %s failed with %d; trying again (%d/%d)",
                what,
                len(batch[0]),
                peer,
                ret,
                attempt + 1,
                retries,
            )
            ret = _attempt(write_batch, batch, stall_s, clock, what, peer)
        if ret != 0:
            raise TransferError(f"{what} of {len(batch[0])} entries to {peer} failed with {ret}")


def _attempt(
    write_batch: BatchWrite,
    batch: tuple[list[int], list[int], list[int]],
    stall_s: float | None,
    clock: Callable[[], float],
    what: str,
    peer: str,
) -> int:
    """One try of one batch; an attempt longer than the transport's bound ``stall_s`` is logged."""
    t0 = clock()
    ret = write_batch(*batch)
    took = clock() - t0
    if stall_s is not None and took > stall_s + overrun_tolerance_s(stall_s):
        logger.error(
            "%s of %d entries to %s took %.1f s, past the transport's %g s batch bound (batch_stall_s, from its "
            "timeout settings, see Timeouts in docs/configuration.md): D's stop wait counts on that bound, so a "
            "reader that gave up meanwhile may already have reused the blocks",
            what,
            len(batch[0]),
            peer,
            took,
            stall_s,
        )
    return int(ret)
