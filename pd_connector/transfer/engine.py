"""Mooncake TransferEngine, as PDConnector uses it (P2PHANDSHAKE, batched writes).

Transports: `tcp` (CPU, any machine), `rdma`, `ascend` (HIXL on NPUs; the NPU
must already be set as the current device, which vLLM-Ascend's worker does
before it builds the connector).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

#: Extra tries of a failed batch write.
WRITE_RETRIES = 1


class TransferError(RuntimeError):
    """A Mooncake call failed."""


class MooncakeEngine:
    """One TransferEngine per worker rank; its session id is what peers write to."""

    def __init__(self, local_ip: str, protocol: str, device_name: str = "") -> None:
        if protocol == "tcp":
            # Without this, a host with RDMA NICs silently uses RDMA despite "tcp".
            os.environ.setdefault("MC_FORCE_TCP", "1")
        # A frozen peer would otherwise stall a TCP write for ~30 s.
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", "10")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransferError(
                "Mooncake is not installed: pip install 'pd-connector[cpu]' (or [ascend] on NPUs); "
                f"import failed with: {exc}"
            ) from exc
        self._engine = TransferEngine()
        ret = self._engine.initialize(local_ip, "P2PHANDSHAKE", protocol, device_name)
        if ret != 0:
            raise TransferError(f"Mooncake initialize({local_ip!r}, {protocol!r}) failed with {ret}")
        self.protocol = protocol
        self.session = f"{local_ip}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        logger.info("Mooncake %s transfer engine up, session %s", protocol, self.session)

    def register(self, ranges: Sequence[tuple[int, int]]) -> None:
        for addr, length in ranges:
            ret = self._engine.register_memory(addr, length)
            if ret != 0:
                raise TransferError(f"Mooncake register_memory(0x{addr:x}, {length}) failed with {ret}")
            self._registered.append(addr)

    def write(
        self,
        session: str,
        src: Sequence[int],
        dst: Sequence[int],
        lengths: Sequence[int],
        max_batch: int,
        still_wanted: Callable[[], bool] | None = None,
    ) -> None:
        """Write src[i] -> session:dst[i], in batches of at most max_batch entries.

        A failed batch is written once more (the same bytes to the same places, so a repeat is
        harmless): Mooncake's TCP transport drops a connection that made no progress for
        MC_TCP_PROGRESS_TIMEOUT_SEC and the next try opens a fresh one. ``still_wanted``, when
        given, is asked first: a reader that gave up may have handed its blocks to someone else.
        """
        for start in range(0, len(src), max_batch):
            end = start + max_batch
            batch = (list(src[start:end]), list(dst[start:end]), list(lengths[start:end]))
            ret = self._engine.batch_transfer_sync_write(session, *batch)
            for attempt in range(WRITE_RETRIES):
                if ret == 0 or (still_wanted is not None and not still_wanted()):
                    break
                logger.warning(
                    "Mooncake batch write of %d entries to %s failed with %d; trying again (%d/%d)",
                    len(batch[0]),
                    session,
                    ret,
                    attempt + 1,
                    WRITE_RETRIES,
                )
                ret = self._engine.batch_transfer_sync_write(session, *batch)
            if ret != 0:
                raise TransferError(f"Mooncake batch write of {len(batch[0])} entries to {session} failed with {ret}")

    def close(self) -> None:
        for addr in self._registered:
            try:
                self._engine.unregister_memory(addr)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        self._registered.clear()
