"""DisaggConfig: PDConnector settings, parsed and validated in one place.

Everything comes from vLLM's `--kv-transfer-config`: `kv_role` decides the
instance's side (producer = prefill, consumer = decode, both = either, per request by its
kv_transfer_params, as vLLM's own connectors treat kv_both) and
`kv_connector_extra_config` holds the keys below, plus the options of the chosen
transfer backend (declared and parsed by the backend, see ``pd_connector.transfer.registry``;
Mooncake's include vLLM-Ascend's ``use_ascend_direct``). Unknown keys and bad values
raise `ConfigError` with a message that names the key.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from pd_connector.ascend import settings as ascend_settings
from pd_connector.ascend.peer_sizes import SideSizes, SizesError, parse_sizes
from pd_connector.auth import AuthError, token_of
from pd_connector.bootstrap.trust import TrustedHosts, TrustError
from pd_connector.kv_params import DEFAULT_BOOTSTRAP_PORT
from pd_connector.transfer import registry as backends


class Mode(StrEnum):
    """An instance's side, from vLLM's ``kv_role``."""

    PREFILL = "prefill"  # kv_producer: prefills for other instances' decode
    DECODE = "decode"  # kv_consumer: decodes requests other instances prefilled
    BOTH = "both"  # kv_both: per request, P for PrefillParams, D for DecodeParams, else an ordinary request


PREFILL = Mode.PREFILL
DECODE = Mode.DECODE
BOTH = Mode.BOTH
#: vLLM's kv_role -> this instance's mode.
KV_ROLES = {"kv_producer": PREFILL, "kv_consumer": DECODE, "kv_both": BOTH}
#: kv_connector_extra_config.transfer_mode values: push a room once its prefill ended, or layer by layer.
TRANSFER_MODES = ("request", "layer")
#: vLLM-Ascend's D2RH port bases (accepted for its configs; PDConnector opens no socket on them).
D2RH_ZMQ_PORT = 38100
D2RH_SCHEDULER_READY_PORT = 38200
#: P's default hold of a finished prefill's KV: vLLM-Ascend's (its VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT default).
ROOM_TIMEOUT_S = 480.0


class ConfigError(ValueError):
    """A PDConnector setting is missing or invalid."""


@dataclass(frozen=True)
class DisaggConfig:
    """Validated PDConnector settings (see README "Configuration")."""

    mode: Mode
    # Bootstrap server of the prefill deployment (hosted by P's leader rank).
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    # Address this rank advertises to peers (ZMQ and Mooncake). Never probed.
    local_ip: str = "127.0.0.1"
    # Transfer backend (pd_connector.transfer.registry), and its own options, parsed by it from its keys (Mooncake's:
    # protocol, device_name, use_ascend_direct, ascend_local_comm_res_path; transfer.mooncake).
    backend: str = backends.DEFAULT_BACKEND
    backend_options: backends.BackendOptions = field(default_factory=backends.default_options)
    # P: how long a finished prefill holds its KV blocks waiting for D (vLLM-Ascend's hold by default).
    room_timeout_s: float = ROOM_TIMEOUT_S
    # D: how long a request waits for its KV before the load counts as failed.
    kv_wait_timeout_s: float = 120.0
    # Both: a peer rank this rank has pending work with (rooms, loads) that answers no heartbeat for this
    # long is lost: its rooms and loads fail at once (transfer.liveness).
    peer_timeout_s: float = 5.0
    # Bootstrap registration retries (P ranks).
    register_retries: int = 60
    register_interval_s: float = 1.0
    http_timeout_s: float = 10.0
    # Worker threads that run backend writes on P (and D's handshakes).
    transfer_threads: int = 4
    # Largest batch of (src, dst, len) entries handed to the backend in one call (at most its batch_limit).
    max_batch_entries: int = 1024
    # Bytes of the buffer that reshuffles heads for mixed TP on token-major (NHD) KV: P allocates it on the
    # KV's device, 2 MiB-aligned, and registers it with the KV (transfer.staging); 0: mixed TP on NHD is refused.
    staging_bytes: int = 64 << 20
    # Start the bootstrap server in this instance's leader (P only).
    start_bootstrap_server: bool = True
    # P: this instance's data-parallel rank and the deployment's DP size, when vLLM does
    # not know them (independent dense DP ranks). -1: take them from vLLM's parallel config.
    dp_rank: int = -1
    dp_size: int = -1
    # vLLM-Ascend's keys: the P and D deployments' {dp_size, tp_size} (checked, see peer_sizes).
    prefill: SideSizes | None = None
    decode: SideSizes | None = None
    # HIXL channel QoS when this side initiates the transfer (0..4), merged into ASCEND_GLOBAL_RESOURCE_CONFIG
    # when the backend uses HIXL (ascend.settings); also there: tls_config, VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT.
    qos_priority: int = ascend_settings.DEFAULT_QOS
    # Control-plane secret (pd_connector.auth): a file or an environment variable holding it.
    auth_token_file: str = ""
    auth_token_env: str = ""
    # Run without a token on a non-loopback address on purpose (bootstrap.exposure; refused otherwise).
    insecure: bool = False
    # TLS of P's bootstrap server (certificate and key files, PEM, as `vllm serve --ssl-certfile/--ssl-keyfile`),
    # and the CA bundle clients verify it with: set, bootstrap calls use https (P's ranks and D).
    bootstrap_ssl_certfile: str = ""
    bootstrap_ssl_keyfile: str = ""
    bootstrap_ssl_ca_certs: str = ""
    # D: bootstrap hosts a request may name (bootstrap.trust): IPs, CIDRs, host names, "*".
    # Empty: this instance's bootstrap_host; loopback too when local_ip is loopback (bootstrap.trust).
    trusted_bootstrap_hosts: tuple[str, ...] = ()
    # D: hosts of the metaservers a D-first request may name (pd_connector.ascend.metaserver; same entry forms).
    # Empty: loopback only when local_ip is loopback, else none.
    trusted_metaservers: tuple[str, ...] = ()
    # D: mutual TLS of its posts to a metaserver (vLLM-Ascend's tls_config, ascend_settings): the client
    # certificate and key D presents (PEM; the key's password, if any), and the CA bundle it verifies the
    # metaserver with (empty: the system's). Used for https metaserver URLs only.
    metaserver_ssl_certfile: str = ""
    metaserver_ssl_keyfile: str = ""
    metaserver_ssl_keyfile_password: str = field(default="", repr=False)
    metaserver_ssl_ca_certs: str = ""
    # D: check a checksum of what landed before a load counts as done (transfer.checksum).
    verify_kv: bool = False
    # P: "request" pushes a room's KV once its prefill finished; "layer" writes each layer's KV while
    # the prefill runs (transfer.layerwise), so only the last layer's write is left when it ends.
    transfer_mode: str = "request"
    # D: D2RH mode (vLLM-Ascend's MooncakeD2RHConnectorV1; pd_connector.d2rh.scheduler): P pushes into a host KV pool,
    # device blocks are given only once the host copy is ready. host_pool_blocks: its size (0: the device
    # cache's block count). vLLM-Ascend's d2rh_zmq_port / d2rh_scheduler_ready_port are accepted (either one
    # turns d2rh on when d2rh is not given) and open no socket: the rank's one ZMQ channel and vLLM's worker
    # metadata carry what their sockets carry.
    d2rh: bool = False
    host_pool_blocks: int = 0
    d2rh_zmq_port: int = D2RH_ZMQ_PORT
    d2rh_scheduler_ready_port: int = D2RH_SCHEDULER_READY_PORT
    # D: a request aborted while it carries a migrate_room (kv_params) keeps its KV as that room for
    # migrate_hold_s, for another decoder to load (a Router drain moving it; pd_connector.scheduling.migration). D's ranks
    # then also push KV (a PrefillSide) and its leader hosts a bootstrap server at bootstrap_port.
    migration: bool = False
    migrate_hold_s: float = 10.0

    @property
    def is_prefill(self) -> bool:
        """This instance prefills for other instances: P, and kv_both (for its PrefillParams requests)."""
        return self.mode in (PREFILL, BOTH)

    @property
    def is_decode(self) -> bool:
        """This instance loads KV other instances prefilled: D, and kv_both (for its DecodeParams requests)."""
        return self.mode in (DECODE, BOTH)

    @property
    def is_both(self) -> bool:
        """kv_role kv_both: which side a request takes is decided by its kv_transfer_params."""
        return self.mode is BOTH

    @property
    def pushes_kv(self) -> bool:
        """This instance's ranks push KV to decode ranks: P, kv_both, and D with ``migration`` (its held rooms)."""
        return self.is_prefill or self.migration


_FIELD_TYPES: dict[str, type] = {
    "bootstrap_host": str,
    "bootstrap_port": int,
    "local_ip": str,
    "backend": str,
    "room_timeout_s": float,
    "kv_wait_timeout_s": float,
    "peer_timeout_s": float,
    "register_retries": int,
    "register_interval_s": float,
    "http_timeout_s": float,
    "transfer_threads": int,
    "max_batch_entries": int,
    "staging_bytes": int,
    "start_bootstrap_server": bool,
    "dp_rank": int,
    "dp_size": int,
    "prefill": SideSizes,
    "decode": SideSizes,
    "qos_priority": int,
    "auth_token_file": str,
    "auth_token_env": str,
    "insecure": bool,
    "bootstrap_ssl_certfile": str,
    "bootstrap_ssl_keyfile": str,
    "bootstrap_ssl_ca_certs": str,
    "trusted_bootstrap_hosts": tuple,
    "trusted_metaservers": tuple,
    "metaserver_ssl_certfile": str,
    "metaserver_ssl_keyfile": str,
    "metaserver_ssl_keyfile_password": str,
    "metaserver_ssl_ca_certs": str,
    "verify_kv": bool,
    "transfer_mode": str,
    "d2rh": bool,
    "host_pool_blocks": int,
    "d2rh_zmq_port": int,
    "d2rh_scheduler_ready_port": int,
    "migration": bool,
    "migrate_hold_s": float,
}
assert set(_FIELD_TYPES) == {f.name for f in fields(DisaggConfig)} - {"mode", "backend_options"}


def _coerce(key: str, value: Any, typ: type) -> Any:
    if typ is tuple:  # a list of strings, or one comma-separated string
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            raise ConfigError(f"kv_connector_extra_config.{key} must be a list of strings, got {value!r}")
        return tuple(v.strip() for v in items if v.strip())
    if typ is SideSizes:
        try:
            return parse_sizes(key, value)
        except SizesError as exc:
            raise ConfigError(str(exc)) from None
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
            return value.lower() in ("1", "true", "yes")
        raise ConfigError(f"kv_connector_extra_config.{key} must be a boolean, got {value!r}")
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"kv_connector_extra_config.{key} must be an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"kv_connector_extra_config.{key} must be an integer, got {value!r}") from None
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"kv_connector_extra_config.{key} must be a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"kv_connector_extra_config.{key} must be a number, got {value!r}") from None
    if not isinstance(value, str):
        raise ConfigError(f"kv_connector_extra_config.{key} must be a string, got {value!r}")
    return value


def parse_config(kv_role: str | None, extra: dict[str, Any] | None) -> DisaggConfig:
    """Build a DisaggConfig from vLLM's kv_role and kv_connector_extra_config."""
    mode = KV_ROLES.get(kv_role or "")
    if mode is None:
        raise ConfigError(
            "PDConnector needs kv_role 'kv_producer' (prefill), 'kv_consumer' (decode) or 'kv_both' (either, per "
            f"request), got {kv_role!r}"
        )
    extra = dict(extra or {})
    tls = extra.pop(ascend_settings.TLS_CONFIG, None)  # vLLM-Ascend's form of the bootstrap_ssl_* keys
    owners = backends.option_owners()  # backend option key -> the backends that take it
    unknown = sorted(set(extra) - set(_FIELD_TYPES) - set(owners))
    if unknown:
        known = sorted({*_FIELD_TYPES, *owners, *ascend_settings.EXTRA_KEYS})
        raise ConfigError(f"unknown kv_connector_extra_config key(s) {unknown}; known keys: {known}")
    if "d2rh" not in extra and ("d2rh_zmq_port" in extra or "d2rh_scheduler_ready_port" in extra):
        extra["d2rh"] = True  # vLLM-Ascend's D2RH config (its port keys) without our switch: D2RH is meant
    values = {key: _coerce(key, extra.pop(key), typ) for key, typ in _FIELD_TYPES.items() if key in extra}
    values["backend_options"] = _backend_options(values.get("backend", backends.DEFAULT_BACKEND), extra, owners)
    try:  # tls_config, VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, qos_priority
        ascend_settings.resolve(mode in (PREFILL, BOTH), values, tls, hixl=values["backend_options"].uses_hixl)
    except ascend_settings.SettingError as exc:
        raise ConfigError(str(exc)) from None
    own = values.get(PREFILL if mode is BOTH else mode.value)
    if mode in (PREFILL, BOTH) and own is not None and own.dp_size is not None:
        if values.setdefault("dp_size", own.dp_size) != own.dp_size:
            raise ConfigError(
                f"kv_connector_extra_config.dp_size is {values['dp_size']} but prefill.dp_size is {own.dp_size}; "
                "they name the same DP size"
            )
    cfg = DisaggConfig(mode=mode, **values)
    _validate(cfg)
    _validate_both(cfg)
    _validate_migration(cfg, explicit_port="bootstrap_port" in values)
    try:
        token_of(cfg)
    except AuthError as exc:
        raise ConfigError(str(exc)) from None
    return cfg


def _backend_options(name: str, raw: dict[str, Any], owners: dict[str, list[str]]) -> backends.BackendOptions:
    """Backend ``name``'s options from its keys in ``raw`` (the extra config's keys left after DisaggConfig's)."""
    try:
        spec = backends.spec_of(name)
    except backends.UnknownBackendError as exc:
        raise ConfigError(f"kv_connector_extra_config.backend: {exc}") from None
    foreign = sorted(set(raw) - set(spec.keys))
    if foreign:
        key = foreign[0]
        raise ConfigError(
            f"kv_connector_extra_config.{key} is an option of the {owners[key]} backend(s), not of backend {name!r}"
        )
    try:
        return spec.parse({key: _coerce(key, val, spec.keys[key]) for key, val in raw.items()})
    except backends.OptionError as exc:
        raise ConfigError(str(exc)) from None


def _validate(cfg: DisaggConfig) -> None:
    if not 1 <= cfg.bootstrap_port <= 65535:
        raise ConfigError(f"kv_connector_extra_config.bootstrap_port must be in 1..65535, got {cfg.bootstrap_port}")
    try:
        ip = ipaddress.ip_address(cfg.local_ip)
    except ValueError:
        raise ConfigError(
            f"kv_connector_extra_config.local_ip must be an IP address peers can reach, got {cfg.local_ip!r}"
        ) from None
    if ip.is_unspecified:
        raise ConfigError("kv_connector_extra_config.local_ip must not be 0.0.0.0: it is advertised to peers")
    if not cfg.bootstrap_host or cfg.bootstrap_host == "*":
        raise ConfigError(
            f"kv_connector_extra_config.bootstrap_host must be a host name or IP, got {cfg.bootstrap_host!r}"
        )
    timeouts = ("room_timeout_s", "kv_wait_timeout_s", "peer_timeout_s", "register_interval_s", "http_timeout_s")
    for key in (*timeouts, "migrate_hold_s"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"kv_connector_extra_config.{key} must be > 0, got {getattr(cfg, key)}")
    if not 0.5 <= cfg.peer_timeout_s <= 3600:  # shorter: a scheduling hiccup would count as a dead peer
        raise ConfigError(f"kv_connector_extra_config.peer_timeout_s must be in 0.5..3600 s, got {cfg.peer_timeout_s}")
    if cfg.register_retries < 1:
        raise ConfigError(f"kv_connector_extra_config.register_retries must be >= 1, got {cfg.register_retries}")
    if cfg.transfer_threads < 1:
        raise ConfigError(f"kv_connector_extra_config.transfer_threads must be >= 1, got {cfg.transfer_threads}")
    if cfg.dp_size != -1 and cfg.dp_size < 1:
        raise ConfigError(f"kv_connector_extra_config.dp_size must be >= 1, got {cfg.dp_size}")
    if cfg.dp_rank != -1 and not 0 <= cfg.dp_rank < (cfg.dp_size if cfg.dp_size != -1 else 1 << 16):
        raise ConfigError(f"kv_connector_extra_config.dp_rank must be in 0..dp_size-1, got {cfg.dp_rank}")
    _validate_tls(cfg)
    try:
        TrustedHosts.parse([cfg.bootstrap_host], key="bootstrap_host")
        TrustedHosts.parse(cfg.trusted_bootstrap_hosts)
        TrustedHosts.parse(cfg.trusted_metaservers, key="trusted_metaservers")
    except TrustError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.staging_bytes < 0:
        raise ConfigError(f"kv_connector_extra_config.staging_bytes must be >= 0, got {cfg.staging_bytes}")
    if cfg.transfer_mode not in TRANSFER_MODES:
        raise ConfigError(
            f"kv_connector_extra_config.transfer_mode must be one of {TRANSFER_MODES}, got {cfg.transfer_mode!r}"
        )
    if cfg.host_pool_blocks < 0:
        raise ConfigError(f"kv_connector_extra_config.host_pool_blocks must be >= 0, got {cfg.host_pool_blocks}")
    for key in ("d2rh_zmq_port", "d2rh_scheduler_ready_port"):
        if not 1 <= getattr(cfg, key) <= 65535:
            raise ConfigError(f"kv_connector_extra_config.{key} must be in 1..65535, got {getattr(cfg, key)}")
    limit = cfg.backend_options.batch_limit
    if not 1 <= cfg.max_batch_entries <= limit:
        raise ConfigError(
            f"kv_connector_extra_config.max_batch_entries must be in 1..{limit} (the {cfg.backend!r} backend's "
            f"largest batch), got {cfg.max_batch_entries}"
        )


def _validate_both(cfg: DisaggConfig) -> None:
    """kv_both runs request mode, one DP rank, no D2RH and no migration (each refused by name).

    vLLM's own DP and PP sizes are refused at start-up (pd_connector.refusals.both_problem)."""
    if not cfg.is_both:
        return
    refused = (
        ("d2rh", cfg.d2rh, "D2RH's host KV pool"),
        ("transfer_mode", cfg.transfer_mode == "layer", "transfer_mode 'layer'"),
        ("migration", cfg.migration, "migration"),
        ("dp_size", cfg.dp_size > 1, f"dp_size {cfg.dp_size}"),
    )
    for key, on, what in refused:
        if on:
            raise ConfigError(
                f"kv_connector_extra_config.{key}: {what} is not supported with kv_role kv_both; start this instance "
                "as kv_producer or kv_consumer, or without that setting"
            )


def _validate_migration(cfg: DisaggConfig, explicit_port: bool) -> None:
    """``migration`` is D's (kv_consumer), not with D2RH, and needs D's own bootstrap_port named."""
    if not cfg.migration:
        return
    if cfg.is_prefill:
        raise ConfigError(
            "kv_connector_extra_config.migration is a decode (kv_role kv_consumer) option: it lets a decoder's "
            "aborted requests keep their KV for another decoder; this instance is kv_producer"
        )
    if cfg.d2rh:
        raise ConfigError("kv_connector_extra_config.migration with d2rh is not supported")
    if not explicit_port:
        raise ConfigError(
            "kv_connector_extra_config.migration needs bootstrap_port set: the decoder serves its own bootstrap "
            "server there (another port than the prefill's on the same host)"
        )


def _validate_tls(cfg: DisaggConfig) -> None:
    if bool(cfg.bootstrap_ssl_certfile) != bool(cfg.bootstrap_ssl_keyfile):
        raise ConfigError(
            "kv_connector_extra_config.bootstrap_ssl_certfile and bootstrap_ssl_keyfile go together: set both or neither"
        )
    for key in ("bootstrap_ssl_certfile", "bootstrap_ssl_keyfile", "bootstrap_ssl_ca_certs"):
        path = getattr(cfg, key)
        if path and not os.access(path, os.R_OK):
            raise ConfigError(f"kv_connector_extra_config.{key} {path!r} is not a readable file")
    if cfg.bootstrap_ssl_certfile and cfg.is_prefill and not cfg.bootstrap_ssl_ca_certs:
        raise ConfigError(
            "kv_connector_extra_config.bootstrap_ssl_certfile is set but bootstrap_ssl_ca_certs is not: P's ranks "
            "register over https and verify the server with it (for a self-signed certificate: the certificate)"
        )
