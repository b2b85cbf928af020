"""``backend: null``, for measuring PDConnector's own cost: writes are accepted and complete at once,
no byte moves.

``benchmarks/transfer.py --backend null`` runs the connector's whole transfer path (bootstrap route,
handshake, write plan, write guard, batching, the batch pipeline of ``backend.write_pipelined``, the
DONE message) over it, so what the run costs is PDConnector's CPU alone, independent of any wire.

It is never selectable by accident: the registry does not know the name ``null`` until
``enable()`` registers it (a benchmark or a test calls it); a deployment's ``backend: null`` is an
unknown backend. D's blocks keep whatever they held: nothing is written into them.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pd_connector.transfer.backend import PIPELINE_DEPTH, Ints, TransferError, Wanted, write_pipelined
from pd_connector.transfer.registry import BackendSpec, NoOptions, register_spec

if TYPE_CHECKING:
    from pd_connector.config import DisaggConfig

#: The backend's name, known to the registry only after ``enable()``.
NAME = "null"

_IDS = itertools.count(1)
#: Batch limit of the null backend: Mooncake's, so a run batches as a Mooncake deployment does.
NULL_BATCH_LIMIT = 1024


class NullPipe:
    """The null transport's batch pipeline: a submitted batch has already ended (handle 0: landed)."""

    def __init__(self, owner: NullBackend) -> None:
        self._owner = owner

    def submit(self, src: list[int], dst: list[int], lengths: list[int]) -> int:
        self._owner.count(len(src))
        return 0

    def wait(self, handle: int) -> int:
        return handle


class NullBackend:
    """Accepts every write to a known descriptor, moves nothing, counts batches and entries."""

    def __init__(self, depth: int = PIPELINE_DEPTH) -> None:
        self._descriptor = f"null:{os.getpid()}:{next(_IDS)}".encode()
        self._depth = depth
        self._lock = threading.Lock()
        self.batches = 0
        self.entries = 0
        self.ranges: list[tuple[int, int]] = []

    @classmethod
    def from_config(cls, cfg: DisaggConfig) -> NullBackend:
        return cls()

    @property
    def descriptor(self) -> bytes:
        return self._descriptor

    def count(self, entries: int) -> None:
        with self._lock:
            self.batches += 1
            self.entries += entries

    def register(self, ranges: Sequence[tuple[int, int]]) -> None:
        self.ranges.extend(ranges)

    def write(
        self, peer_descriptor: bytes, src: Ints, dst: Ints, lengths: Ints, max_batch: int, still_wanted: Wanted = None
    ) -> None:
        if not peer_descriptor.startswith(b"null:"):
            raise TransferError(f"the null backend cannot write to {peer_descriptor!r} (not a null backend)")
        write_pipelined(
            NullPipe(self),
            src,
            dst,
            lengths,
            max_batch,
            still_wanted,
            what="null write",
            peer=peer_descriptor.decode(),
            depth=self._depth,
        )

    def close(self) -> None:
        self.ranges.clear()


def _options(raw: Mapping[str, Any]) -> NoOptions:
    return NoOptions(batch_limit=NULL_BATCH_LIMIT)


BACKEND = BackendSpec(open=NullBackend.from_config, parse=_options)


def enable() -> None:
    """Make ``backend: null`` known in this process (benchmarks and tests only)."""
    register_spec(NAME, BACKEND)
