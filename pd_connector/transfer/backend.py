"""TransferBackend: the seam between the transfer manager and whatever moves the bytes.

A backend is opened for one worker rank (see ``registry``), registers that rank's KV memory,
and writes local byte ranges into a peer's registered memory. Peers find each other through
``descriptor``: opaque bytes the backend hands out, carried to the other side in the ZMQ
handshake (``PeerHello.transfer_descriptor``) and given back to ``write``. The manager never
looks inside a descriptor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

logger = logging.getLogger(__name__)

#: Extra tries of a failed batch write (the same bytes to the same places, so a repeat is harmless).
WRITE_RETRIES = 1
#: The longest one batch write may take before it fails: Mooncake's TCP transport drops a connection
#: that made no progress for this long (MC_TCP_PROGRESS_TIMEOUT_SEC, set by ``mooncake``); RDMA and
#: HIXL batches complete or fail far sooner. With the retries, P's slowest batch is
#: ``(1 + WRITE_RETRIES) * BATCH_STALL_S``; D holds a stopped load's blocks longer (``loads``).
BATCH_STALL_S = 10.0


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
) -> None:
    """Call ``write_batch(src, dst, lengths) -> status`` (0: ok) per batch of at most max_batch entries.

    ``still_wanted()`` is asked before every batch: once the reader gave up, no further batch starts
    (WriteStopped), so at most the batch in flight lands after a cancel; D keeps the blocks until P
    answered, i.e. until this returned or raised. A failed batch is written again up to ``retries``
    times unless the reader gave up; a batch that still fails raises TransferError. ``what`` and ``peer`` name the
    write in messages ("Mooncake batch write of 12 entries to 10.0.0.3:15000 failed with -1").
    """
    for start in range(0, len(src), max_batch):
        if still_wanted is not None and not still_wanted():
            raise WriteStopped(f"{what} to {peer} stopped after {start} of {len(src)} entries: the reader gave up")
        end = start + max_batch
        batch = (list(src[start:end]), list(dst[start:end]), list(lengths[start:end]))
        ret = write_batch(*batch)
        for attempt in range(retries):
            if ret == 0 or (still_wanted is not None and not still_wanted()):
                break
            logger.warning(
                "%s of %d entries to %s failed with %d; trying again (%d/%d)",
                what,
                len(batch[0]),
                peer,
                ret,
                attempt + 1,
                retries,
            )
            ret = write_batch(*batch)
        if ret != 0:
            raise TransferError(f"{what} of {len(batch[0])} entries to {peer} failed with {ret}")
