"""Mooncake TransferEngine as a TransferBackend (P2PHANDSHAKE, batched writes).

Transports (``kv_connector_extra_config.protocol``): `tcp` (CPU, any machine), `rdma`,
`ascend` (HIXL on NPUs; the NPU must already be set as the current device, which
vLLM-Ascend's worker does before it builds the connector). The descriptor peers write
to is the engine's session, ``ip:rpc_port``, as ASCII bytes.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pd_connector.transfer.backend import BATCH_STALL_S, Ints, TransferError, Wanted, write_in_batches

if TYPE_CHECKING:
    from pd_connector.config import DisaggConfig

logger = logging.getLogger(__name__)

#: Mooncake transports (the ``protocol`` option).
PROTOCOLS = ("tcp", "rdma", "ascend")


class MooncakeBackend:
    """One Mooncake TransferEngine per worker rank; its session is what peers write to."""

    def __init__(self, engine: Any, session: str, protocol: str = "tcp") -> None:
        """Wrap an initialized ``mooncake.engine.TransferEngine`` (see :meth:`open`)."""
        self._engine = engine
        self.session = session
        self.protocol = protocol
        self._registered: list[int] = []

    @classmethod
    def open(cls, local_ip: str, protocol: str, device_name: str = "") -> MooncakeBackend:
        if protocol == "tcp":
            # Without this, a host with RDMA NICs silently uses RDMA despite "tcp".
            os.environ.setdefault("MC_FORCE_TCP", "1")
        # A frozen peer would otherwise stall a TCP write for ~30 s (D's stop wait relies on this bound).
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(int(BATCH_STALL_S)))
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransferError(
                "Mooncake is not installed: pip install 'pd-connector[cpu]' (or [ascend] on NPUs); "
                f"import failed with: {exc}"
            ) from exc
        engine = TransferEngine()
        ret = engine.initialize(local_ip, "P2PHANDSHAKE", protocol, device_name)
        if ret != 0:
            raise TransferError(f"Mooncake initialize({local_ip!r}, {protocol!r}) failed with {ret}")
        backend = cls(engine, f"{local_ip}:{engine.get_rpc_port()}", protocol)
        logger.info("Mooncake %s transfer engine up, session %s", protocol, backend.session)
        return backend

    @classmethod
    def from_config(cls, cfg: DisaggConfig) -> MooncakeBackend:
        return cls.open(cfg.local_ip, cfg.protocol, cfg.device_name)

    @property
    def descriptor(self) -> bytes:
        return self.session.encode("ascii")

    def register(self, ranges: Sequence[tuple[int, int]]) -> None:
        for addr, length in ranges:
            ret = self._engine.register_memory(addr, length)
            if ret != 0:
                raise TransferError(f"Mooncake register_memory(0x{addr:x}, {length}) failed with {ret}")
            self._registered.append(addr)

    def write(
        self, peer_descriptor: bytes, src: Ints, dst: Ints, lengths: Ints, max_batch: int, still_wanted: Wanted = None
    ) -> None:
        """Write src[i] -> peer:dst[i] in batches; a failed batch is written once more.

        Mooncake's TCP transport drops a connection that made no progress for
        MC_TCP_PROGRESS_TIMEOUT_SEC and the next try opens a fresh one.
        """
        session = peer_descriptor.decode("ascii")

        def write_batch(s: list[int], d: list[int], n: list[int]) -> int:
            return int(self._engine.batch_transfer_sync_write(session, s, d, n))

        write_in_batches(
            write_batch, src, dst, lengths, max_batch, still_wanted, what="Mooncake batch write", peer=session
        )

    def close(self) -> None:
        for addr in self._registered:
            try:
                self._engine.unregister_memory(addr)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        self._registered.clear()
