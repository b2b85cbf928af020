"""Mooncake TransferEngine as a TransferBackend (P2PHANDSHAKE, batched writes), and its options.

Transports (``kv_connector_extra_config.protocol``): `tcp` (CPU, any machine), `rdma`,
`ascend` (HIXL on NPUs; the NPU must already be set as the current device, which
vLLM-Ascend's worker does before it builds the connector). Left out: the platform's
(``ascend`` on NPUs, ``tcp`` elsewhere). The descriptor peers write to is the engine's
session, ``ip:rpc_port``, as ASCII bytes.

Its keys (``MooncakeOptions``): ``protocol``, ``device_name`` (the RDMA NIC), and vLLM-Ascend's
``use_ascend_direct`` (means protocol ``ascend``) and ``ascend_local_comm_res_path`` (the A5 HIXL
endpoint directory, ``ascend.env``).

Where it listens: this Mooncake version (mooncake-transfer-engine 0.3.13) binds its sockets to every
interface whatever ``local_ip`` is: the RPC/handshake port (``findAvailableTcpPort`` binds ``INADDR_ANY``)
and, with ``protocol: tcp``, the data port (an asio acceptor on ``[::]``, dual-stack). No setting changes
that address (``MC_TCP_BIND_ADDRESS`` only names the address it *advertises* outside P2PHANDSHAKE mode);
``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT`` (default 15000-17000) bound the ports of both. ``open`` logs the
listeners it made, so a firewall can be checked against them (docs/security.md, "What listens where").

How one write moves (``MooncakePipe``): its entries go in batches of at most ``max_batch_entries``,
up to ``backend.PIPELINE_DEPTH`` batches in flight (``batch_transfer_async_write``, then
``get_batch_transfer_status`` per batch in submission order), so the transport always has the next
batch queued; ``write`` returns once every batch landed or, failing, once none is in flight. All
writes of a backend together keep at most the TCP transport's queue per peer in flight
(``PeerCredits``, ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``, 1024): Mooncake fails entries past it.

How long one batch may take (``MooncakeOptions.batch_stall_s``, ``stall_for``): Mooncake's Python
binding gives up on a batch (``TransferEnginePy::getBatchTransferStatus``, and ``batchTransferSync``
alike) after ``MC_TRANSFER_TIMEOUT`` s (default 30, at least 5) plus 1 ns per byte of the batch,
counted from its submission, whatever the transport, but the transport may still be moving that batch's bytes until its own timeout fails them:
``tcp`` drops a connection that made no progress for ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (``open`` sets 10
when unset; Mooncake's own default is 30), ``ascend`` (HIXL) fails a transfer after
``ASCEND_TRANSFER_TIMEOUT`` ms (``ascend.settings`` derives it as vLLM-Ascend does when unset), ``rdma``
fails a work request after the NIC's retransmits (QP timeout 14, 7 retries: about 0.5 s, inside the
binding's bound). A batch's bound is the longer of the binding's and its transport's.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pd_connector.ascend import settings as ascend_settings
from pd_connector.ascend.env import setup_local_comm_res
from pd_connector.ascend.platform import on_npu
from pd_connector.transfer.backend import PIPELINE_DEPTH, Ints, TransferError, Wanted, write_pipelined
from pd_connector.transfer.proc_sockets import TABLES, listen_table, socket_inodes
from pd_connector.transfer.registry import BackendSpec, OptionError

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

#: The binding's bound on one batch write (seconds): MC_TRANSFER_TIMEOUT, its default, its floor.
CALL_TIMEOUT_ENV, CALL_TIMEOUT_DEFAULT_S, CALL_TIMEOUT_FLOOR_S = "MC_TRANSFER_TIMEOUT", 30, 5
#: Entries Mooncake's TCP transport queues per peer (``PeerCredits``): its setting and default.
QUEUE_ENV, QUEUE_DEFAULT = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", 1024
#: The TCP transport's no-progress bound (seconds): what ``open`` sets when unset, and what Mooncake
#: uses for a value it ignores (not a positive integer).
TCP_PROGRESS_ENV, TCP_PROGRESS_S, TCP_PROGRESS_MOONCAKE_S = "MC_TCP_PROGRESS_TIMEOUT_SEC", 10, 30


def _env_seconds(env: Mapping[str, str], name: str, what: str) -> int | None:
    """An integer environment variable (None when unset or blank); anything else is refused by name."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw)
    except ValueError:
        raise OptionError(f"environment variable {name}={raw!r} must be a whole number ({what})") from None


def stall_for(protocol: str, env: Mapping[str, str]) -> float:
    """``batch_stall_s`` of the Mooncake ``protocol`` under ``env``: the longer of the binding's bound
    on one batch (MC_TRANSFER_TIMEOUT) and the transport's own (module docstring)."""
    call = _env_seconds(env, CALL_TIMEOUT_ENV, "seconds Mooncake waits for one batch write")
    call_s = float(max(CALL_TIMEOUT_FLOOR_S, CALL_TIMEOUT_DEFAULT_S if call is None else call))
    if protocol == "tcp":
        progress = _env_seconds(env, TCP_PROGRESS_ENV, "seconds a Mooncake TCP write may make no progress")
        progress_s = TCP_PROGRESS_S if progress is None else progress if progress > 0 else TCP_PROGRESS_MOONCAKE_S
        return max(call_s, float(progress_s))
    if protocol == "ascend":
        return max(call_s, ascend_timeout_ms(env) / 1000)
    return call_s  # rdma: a work request fails after the NIC's retransmits, well inside the binding's bound


def ascend_timeout_ms(env: Mapping[str, str]) -> int:
    """HIXL's transfer timeout: ASCEND_TRANSFER_TIMEOUT (ms) if set, else vLLM-Ascend's derivation."""
    name = ascend_settings.TRANSFER_TIMEOUT_ENV
    given = _env_seconds(env, name, "milliseconds HIXL waits for one transfer")
    if given is not None:
        if given < 1:
            raise OptionError(f"environment variable {name}={env[name]!r} must be a whole number of ms >= 1")
        return given
    try:
        return ascend_settings.transfer_timeout_ms(env)
    except ascend_settings.SettingError as exc:
        raise OptionError(str(exc)) from None


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
    #: Derived (``stall_for``) from the protocol and this process's environment when not given.
    batch_stall_s: float = field(default=-1.0, compare=False)

    def __post_init__(self) -> None:
        if self.batch_stall_s < 0:
            object.__setattr__(self, "batch_stall_s", stall_for(self.protocol, os.environ))

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

    def __init__(
        self,
        engine: Any,
        session: str,
        protocol: str = "tcp",
        stall_s: float | None = None,
        depth: int = PIPELINE_DEPTH,
    ) -> None:
        """Wrap an initialized ``mooncake.engine.TransferEngine`` (see :meth:`open`); ``stall_s``: the
        options' ``batch_stall_s``, which bounds each batch and its retries (``write_pipelined``);
        ``depth``: batches of one write in flight at most."""
        self._engine = engine
        self.session = session
        self.protocol = protocol
        self.stall_s = stall_s
        self.depth = depth
        # TCP: the transport's queue per peer; other transports: Mooncake's batch limit (what one sync
        # batch of max_batch_entries put in flight before writes were pipelined).
        self.credits = PeerCredits(queue_limit(os.environ) if protocol == "tcp" else BATCH_LIMIT)
        self._registered: list[int] = []

    @classmethod
    def open(cls, local_ip: str, protocol: str, device_name: str = "", stall_s: float | None = None) -> MooncakeBackend:
        """Initialize a TransferEngine advertising ``local_ip`` (it listens on every interface, see above)."""
        if protocol == "tcp":
            # Without this, a host with RDMA NICs silently uses RDMA despite "tcp".
            os.environ.setdefault("MC_FORCE_TCP", "1")
        # A frozen peer would otherwise stall a TCP write for Mooncake's 30 s; stall_for assumes this value.
        os.environ.setdefault(TCP_PROGRESS_ENV, str(TCP_PROGRESS_S))
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
        backend = cls(engine, f"{local_ip}:{engine.get_rpc_port()}", protocol, stall_s)
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
        return cls.open(cfg.local_ip, options.protocol, options.device_name, options.batch_stall_s)

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
        """Write src[i] -> peer:dst[i] in batches, up to ``depth`` of them in flight (``MooncakePipe``),
        each of at most ``max_batch`` entries and of at most a ``depth``-th of what one peer may have in
        flight (``PeerCredits``); a failed batch is written once more while that retry fits in the batch's
        budget (``write_pipelined``, ``stall_s``).

        Mooncake's TCP transport drops a connection that made no progress for
        MC_TCP_PROGRESS_TIMEOUT_SEC and the next try opens a fresh one.
        """
        session = peer_descriptor.decode("ascii")
        # Batches small enough that ``depth`` of them fit in the entries one peer may have in flight.
        per_batch = max(1, min(max_batch, self.credits.limit // self.depth))
        write_pipelined(
            MooncakePipe(self._engine, session, self.credits),
            src,
            dst,
            lengths,
            per_batch,
            still_wanted,
            what="Mooncake batch write",
            peer=session,
            depth=self.depth,
            stall_s=self.stall_s,
        )

    def close(self) -> None:
        for addr in self._registered:
            try:
                self._engine.unregister_memory(addr)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        self._registered.clear()


class PeerCredits:
    """Entries one engine has in flight per peer, at most ``limit`` (all writes, all threads together).

    Mooncake's TCP transport queues at most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (default 1024)
    entries per peer and fails what it cannot queue (the rest wait for admission at most
    ``MC_TCP_ADMISSION_TIMEOUT_MS``, 1 s, then fail too): several batches in flight must stay inside it.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"Mooncake entries in flight per peer must be >= 1, got {limit}")
        self.limit = limit
        self._used: dict[str, int] = {}
        self._cond = threading.Condition()

    def ready(self, peer: str, entries: int) -> bool:
        """Whether ``entries`` more fit now (a peer with nothing in flight takes any batch)."""
        with self._cond:
            used = self._used.get(peer, 0)
            return used == 0 or used + entries <= self.limit

    def take(self, peer: str, entries: int) -> None:
        """Count ``entries`` in flight to ``peer``, once they fit (waits for other writes' batches)."""
        with self._cond:
            while (used := self._used.get(peer, 0)) and used + entries > self.limit:
                self._cond.wait()
            self._used[peer] = used + entries

    def give(self, peer: str, entries: int) -> None:
        with self._cond:
            left = self._used.get(peer, 0) - entries
            if left > 0:
                self._used[peer] = left
            else:
                self._used.pop(peer, None)
            self._cond.notify_all()

    def in_flight(self, peer: str) -> int:
        with self._cond:
            return self._used.get(peer, 0)


def queue_limit(env: Mapping[str, str]) -> int:
    """Entries Mooncake's TCP transport queues per peer (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``)."""
    given = _env_seconds(env, QUEUE_ENV, "entries Mooncake's TCP transport queues per peer")
    return QUEUE_DEFAULT if given is None or given < 1 else given


class MooncakePipe:
    """One write's batches through Mooncake's asynchronous batch calls.

    ``submit`` is ``batch_transfer_async_write`` (it returns at once with a batch id; the TCP transport
    starts every entry as it is submitted); ``wait`` is ``get_batch_transfer_status([id])``, which
    returns 0 once every entry of the batch completed, or -1 when one failed or the batch outlasted the
    binding's bound (``MC_TRANSFER_TIMEOUT`` plus 1 ns per byte, counted from the submission), and
    frees the batch id. A submission Mooncake refuses (batch id 0: no segment for the peer, or its
    transport refused the entries) is written with ``batch_transfer_sync_write`` instead, which drops a
    stale segment of a restarted peer and reports the status.
    """

    def __init__(self, engine: Any, session: str, credits: PeerCredits) -> None:
        self._engine = engine
        self._session = session
        self._credits = credits

    def ready(self, entries: int) -> bool:
        return self._credits.ready(self._session, entries)

    def reserve(self, entries: int) -> None:
        self._credits.take(self._session, entries)

    def release(self, entries: int) -> None:
        self._credits.give(self._session, entries)

    def submit(self, src: list[int], dst: list[int], lengths: list[int]) -> tuple[bool, int, int]:
        """(True, batch id, entries) of a batch in flight, or (False, status, 0) of one written synchronously.

        Its entries were reserved (``reserve``); they are given back when the batch ended (``wait``),
        or here when it did not go in flight."""
        entries = len(src)
        batch_id = 0
        try:
            batch_id = int(self._engine.batch_transfer_async_write(self._session, src, dst, lengths))
            if batch_id:
                return True, batch_id, entries
            return False, int(self._engine.batch_transfer_sync_write(self._session, src, dst, lengths)), 0
        finally:
            if not batch_id:
                self._credits.give(self._session, entries)

    def wait(self, handle: tuple[bool, int, int]) -> int:
        in_flight, value, entries = handle
        if not in_flight:
            return value
        try:
            return int(self._engine.get_batch_transfer_status([value]))
        finally:
            self._credits.give(self._session, entries)


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
