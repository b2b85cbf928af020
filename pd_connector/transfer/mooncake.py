"""Mooncake TransferEngine as a TransferBackend (P2PHANDSHAKE, batched writes), and its options.

Transports (``kv_connector_extra_config.protocol``): `tcp` (CPU, any machine), `rdma`,
`ascend` (HIXL on NPUs; the NPU must already be set as the current device, which
vLLM-Ascend's worker does before it builds the connector). Left out: the platform's
(``ascend`` on NPUs, ``tcp`` elsewhere). The descriptor peers write to is the engine's
session, ``ip:rpc_port``, as ASCII bytes.

Its keys (``MooncakeOptions``): ``protocol``, ``device_name`` (the RDMA NIC), and vLLM-Ascend's
``use_ascend_direct`` (means protocol ``ascend``) and ``ascend_local_comm_res_path`` (the A5 HIXL
endpoint directory, ``ascend_env``).

Where it listens: this Mooncake version (mooncake-transfer-engine 0.3.13) binds its sockets to every
interface whatever ``local_ip`` is: the RPC/handshake port (``findAvailableTcpPort`` binds ``INADDR_ANY``)
and, with ``protocol: tcp``, the data port (an asio acceptor on ``[::]``, dual-stack). No setting changes
that address (``MC_TCP_BIND_ADDRESS`` only names the address it *advertises* outside P2PHANDSHAKE mode);
``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT`` (default 15000-17000) bound the ports of both. ``open`` logs the
listeners it made, so a firewall can be checked against them (docs/security.md, "What listens where").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_connector.ascend_env import setup_local_comm_res
from pd_connector.platform_transport import on_npu
from pd_connector.proc_sockets import TABLES, listen_table, socket_inodes
from pd_connector.transfer.backend import BATCH_STALL_S, Ints, TransferError, Wanted, write_in_batches
from pd_connector.transfer_backends import BackendSpec, OptionError

if TYPE_CHECKING:
    from pd_connector.config import DisaggConfig

logger = logging.getLogger(__name__)

#: Mooncake transports (the ``protocol`` option).
PROTOCOLS = ("tcp", "rdma", "ascend")
#: Most entries of one batch write: Mooncake's per-peer queue.
BATCH_LIMIT = 1024
#: Device types whose memory each transport cannot read or write.
_UNREACHABLE: dict[str, frozenset[str]] = {"tcp": frozenset({"npu"}), "rdma": frozenset({"npu"})}
#: Most registered memory regions per transport (vLLM-Ascend: MAX_HCCL_REGISTER_REGIONS = 256).
REGION_LIMITS: dict[str, int] = {"ascend": 256}

_KEY = "kv_connector_extra_config"


def default_protocol() -> str:
    """The Mooncake transport of this platform: ``ascend`` on NPUs, ``tcp`` elsewhere."""
    return "ascend" if on_npu() else "tcp"


@dataclass(frozen=True)
class MooncakeOptions:
    """The Mooncake backend's keys, parsed (``parse``) and asked by the start-up checks."""

    protocol: str = "tcp"
    device_name: str = ""
    use_ascend_direct: bool = False
    ascend_local_comm_res_path: str = ""
    batch_limit: int = BATCH_LIMIT

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> MooncakeOptions:
        """Options from the given keys (coerced to KEYS' types); the protocol defaults to the platform's."""
        values = dict(raw)
        if values.get("use_ascend_direct") and values.setdefault("protocol", "ascend") != "ascend":
            raise OptionError(
                f"{_KEY}.use_ascend_direct is true (the ascend transport) but protocol is "
                f"{values['protocol']!r}; drop one of them"
            )
        values.setdefault("protocol", default_protocol())
        if values["protocol"] not in PROTOCOLS:
            raise OptionError(
                f"{_KEY}.protocol (Mooncake transport) must be one of {PROTOCOLS}, got {values['protocol']!r}"
            )
        return cls(**values)

    @property
    def uses_hixl(self) -> bool:
        return self.protocol == "ascend"

    def memory_problem(self, device_types: Iterable[str], regions: int, staging: int) -> str | None:
        bad = sorted(set(device_types) & _UNREACHABLE.get(self.protocol, frozenset()))
        if bad:
            return (
                f"{_KEY}.protocol {self.protocol!r} cannot read KV cache memory on device {bad[0]!r}; "
                "use protocol 'ascend' (Mooncake's NPU build) for KV in NPU memory"
            )
        limit = REGION_LIMITS.get(self.protocol)
        if limit is None or regions <= limit:
            return None
        what = f"the KV cache needs {regions} memory regions registered"
        fix = "fewer layers per worker (a larger TP/PP size) or KV tensors allocated next to each other fit"
        if staging:
            what += f" ({regions - staging} of KV and {staging} NHD staging buffer)"
            fix += f"; so does {_KEY}.staging_bytes 0 (no mixed TP on NHD) or decode.tp_size equal to prefill's"
        return f"{what}, but the {self.protocol!r} transport takes at most {limit} (REGION_LIMITS); {fix}"

    def prepare_rank(self, local_rank: int) -> None:
        if self.ascend_local_comm_res_path:
            setup_local_comm_res(self.ascend_local_comm_res_path, local_rank)


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
        """Initialize a TransferEngine advertising ``local_ip`` (it listens on every interface, see above)."""
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
        before = own_listeners()
        ret = engine.initialize(local_ip, "P2PHANDSHAKE", protocol, device_name)
        if ret != 0:
            raise TransferError(f"Mooncake initialize({local_ip!r}, {protocol!r}) failed with {ret}")
        backend = cls(engine, f"{local_ip}:{engine.get_rpc_port()}", protocol)
        logger.info("Mooncake %s transfer engine up, session %s", protocol, backend.session)
        opened = sorted(own_listeners() - before, key=lambda a: a[1])
        if opened:
            logger.warning(
                "Mooncake transfer engine listening on %s (all interfaces, whatever local_ip %s: this Mooncake "
                "version cannot bind one address); allow ports %s-%s (MC_MIN_RPC_PORT/MC_MAX_RPC_PORT) only from "
                "this deployment's P and D hosts, see docs/security.md",
                ", ".join(f"{host_port_text(h, p)}" for h, p in opened),
                local_ip,
                os.environ.get("MC_MIN_RPC_PORT", "15000"),
                os.environ.get("MC_MAX_RPC_PORT", "17000"),
            )
        return backend

    @classmethod
    def from_config(cls, cfg: DisaggConfig) -> MooncakeBackend:
        options = cfg.backend_options
        if not isinstance(options, MooncakeOptions):
            raise TransferError(f"the Mooncake backend needs MooncakeOptions, got {type(options).__name__}")
        return cls.open(cfg.local_ip, options.protocol, options.device_name)

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


def host_port_text(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def own_listeners() -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket this process holds, from /proc (empty elsewhere)."""
    try:
        inodes = socket_inodes()
        found = set()
        for table in TABLES:
            found.update(where for inode, where in listen_table("self", table).items() if inode in inodes)
        return found
    except OSError:
        return set()


BACKEND = BackendSpec(
    open=MooncakeBackend.from_config,
    keys={"protocol": str, "device_name": str, "use_ascend_direct": bool, "ascend_local_comm_res_path": str},
    parse=MooncakeOptions.parse,
)
