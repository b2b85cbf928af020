"""vLLM-Ascend 0.23 settings that PDConnector takes with vLLM-Ascend's meaning.

At parse time (``resolve``, called by ``config.parse_config`` on the coerced keys):

- ``tls_config`` (vLLM-Ascend's ``MooncakeLayerwiseConnector``: the client TLS of D's posts to the
  layer-wise proxy's metaserver, an ``httpx`` client with ``cert=(ssl_certfile, ssl_keyfile,
  ssl_keyfile_password)`` and ``verify=ssl_ca_certs``): ``{"ssl_enable": true, "ssl_certfile",
  "ssl_keyfile", "ssl_keyfile_password", "ssl_ca_certs"}`` becomes ``metaserver_ssl_certfile`` /
  ``metaserver_ssl_keyfile`` / ``metaserver_ssl_keyfile_password`` / ``metaserver_ssl_ca_certs``: the
  certificate D presents to an https metaserver (mutual TLS) and the CA it verifies that metaserver
  with (``pd_connector.ascend.metaserver``). Without ``ssl_ca_certs`` vLLM-Ascend does not verify the
  metaserver; PDConnector verifies it with the system's CA store. ``ssl_enable`` false or absent means
  none of it, as there; both forms naming different things is an error naming both keys. The
  bootstrap server's TLS is not this: it keeps its own keys (``bootstrap_ssl_*``).
- ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` (environment; how long vLLM-Ascend's P keeps a finished
  prefill's KV for D): P's ``room_timeout_s`` when that key is not given.
- ``qos_priority``: HIXL channel QoS of the transfer's initiator, an integer in 0..4 (default 1).

Before the Mooncake engine starts on the ``ascend`` transport (``apply_transport_env``, called by
the worker), as vLLM-Ascend's connectors do:

- ``ASCEND_GLOBAL_RESOURCE_CONFIG`` (JSON object) gets the literal top-level key
  ``"comm_resource_config.qos"`` = ``qos_priority``; the variable is created when absent, its other
  keys are kept, a malformed value fails before anything is written (vLLM-Ascend's QoS setting).
- ``ASCEND_TRANSFER_TIMEOUT`` (ms), when unset, is derived from ``HCCL_RDMA_TIMEOUT`` (default 20)
  and ``HCCL_RDMA_RETRY_CNT`` (default 7) with vLLM-Ascend's formula (``transfer_timeout_ms``);
  a value the user set is kept.
"""

from __future__ import annotations

import json
import logging
import math
import os
import ssl
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pd_connector.config import DisaggConfig

logger = logging.getLogger(__name__)

KEY = "kv_connector_extra_config"
TLS_CONFIG = "tls_config"
#: Keys parse_config takes besides DisaggConfig's fields (folded into them here).
EXTRA_KEYS = (TLS_CONFIG,)
#: tls_config key -> the DisaggConfig field it stands for (D's client TLS toward a metaserver).
TLS_FIELDS = {
    "ssl_certfile": "metaserver_ssl_certfile",
    "ssl_keyfile": "metaserver_ssl_keyfile",
    "ssl_keyfile_password": "metaserver_ssl_keyfile_password",
    "ssl_ca_certs": "metaserver_ssl_ca_certs",
}
TLS_KEYS = ("ssl_enable", *TLS_FIELDS)
#: TLS_FIELDS' values that name files (the password does not).
_TLS_FILES = ("metaserver_ssl_certfile", "metaserver_ssl_keyfile", "metaserver_ssl_ca_certs")

ABORT_TIMEOUT_ENV = "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"
RESOURCE_CONFIG_ENV = "ASCEND_GLOBAL_RESOURCE_CONFIG"
QOS_KEY = "comm_resource_config.qos"
QOS_MIN, QOS_MAX = 0, 4
DEFAULT_QOS = 1
TRANSFER_TIMEOUT_ENV = "ASCEND_TRANSFER_TIMEOUT"
RDMA_TIMEOUT_ENV, RDMA_TIMEOUT_DEFAULT = "HCCL_RDMA_TIMEOUT", 20
RDMA_RETRY_ENV, RDMA_RETRY_DEFAULT = "HCCL_RDMA_RETRY_CNT", 7


class SettingError(ValueError):
    """A vLLM-Ascend setting (extra-config key or environment variable) is invalid; the message names it."""


# ------------------------------------------------------------------ parse time


def resolve(
    is_prefill: bool, values: dict[str, Any], tls: Any, env: Mapping[str, str] | None = None, *, hixl: bool = False
) -> None:
    """Fold vLLM-Ascend's settings into the coerced ``values`` of parse_config (in place).

    ``tls``: the ``tls_config`` value, None when absent. ``hixl``: the backend moves bytes over HIXL.
    """
    env = os.environ if env is None else env
    if tls is not None:
        merge_tls(values, tls)
    check_metaserver_tls(values)
    hold_from_env(is_prefill, values, env)
    qos = values.get("qos_priority", DEFAULT_QOS)
    check_qos(qos)
    if hixl:
        merged_resource_config(env.get(RESOURCE_CONFIG_ENV), qos)  # a malformed one stops the server now


def tls_values(tls: Any) -> dict[str, str] | None:
    """The metaserver TLS fields vLLM-Ascend's ``tls_config`` stands for; None when it does not enable TLS."""
    where = f"{KEY}.{TLS_CONFIG}"
    if not isinstance(tls, dict):
        raise SettingError(f"{where} must be an object with keys {list(TLS_KEYS)}, got {tls!r}")
    unknown = sorted(set(tls) - set(TLS_KEYS))
    if unknown:
        raise SettingError(f"unknown key(s) {unknown} in {where}; known keys: {list(TLS_KEYS)}")
    enable = tls.get("ssl_enable", False)
    if not isinstance(enable, bool):
        raise SettingError(f"{where}.ssl_enable must be true or false, got {enable!r}")
    if not enable:
        return None
    out = {}
    for key, field in TLS_FIELDS.items():
        value = tls.get(key)
        if value is None or value is False or value == "":
            continue
        if not isinstance(value, str):
            what = "a string" if key == "ssl_keyfile_password" else "a file path"
            shown = "<hidden>" if key == "ssl_keyfile_password" else repr(value)
            raise SettingError(f"{where}.{key} must be {what}, got {shown}")
        out[field] = value
    return out


def merge_tls(values: dict[str, Any], tls: Any) -> None:
    """Put ``tls_config``'s values into the ``metaserver_ssl_*`` fields; a contradiction names both keys."""
    mapped = tls_values(tls)
    where = f"{KEY}.{TLS_CONFIG}"
    if mapped is None:
        given = [field for field in TLS_FIELDS.values() if values.get(field)]
        if given and "ssl_enable" in tls:
            raise SettingError(f"{where}.ssl_enable is false but {KEY}.{given[0]} is set (TLS on); drop one of them")
        if any(tls.get(key) for key in TLS_FIELDS):
            logger.info("%s.ssl_enable is not true: its certificate files are not used (as in vLLM-Ascend)", where)
        return
    for key, field in TLS_FIELDS.items():
        value, given = mapped.get(field), values.get(field)
        if value and given and value != given:
            if field not in _TLS_FILES:
                raise SettingError(f"{where}.{key} and {KEY}.{field} differ; set one of them")
            raise SettingError(
                f"{where}.{key} is {value!r} but {KEY}.{field} is {given!r}; they name the same file, set one of them"
            )
        if value:
            values[field] = value


def check_metaserver_tls(values: Mapping[str, Any]) -> None:
    """D's metaserver TLS files load (certificate with its key and password, CA bundle); errors name the key."""
    cert, key = values.get("metaserver_ssl_certfile", ""), values.get("metaserver_ssl_keyfile", "")
    password, ca = values.get("metaserver_ssl_keyfile_password", ""), values.get("metaserver_ssl_ca_certs", "")
    if bool(cert) != bool(key):
        raise SettingError(
            f"{KEY}.metaserver_ssl_certfile and metaserver_ssl_keyfile go together (tls_config: ssl_certfile and "
            "ssl_keyfile): set both or neither"
        )
    if password and not key:
        raise SettingError(f"{KEY}.metaserver_ssl_keyfile_password is set but metaserver_ssl_keyfile is not")
    for field in _TLS_FILES:
        path = values.get(field, "")
        if path and not os.access(path, os.R_OK):
            raise SettingError(f"{KEY}.{field} {path!r} is not a readable file")
    try:
        ctx = ssl.create_default_context(cafile=ca or None)
    except (ssl.SSLError, OSError) as exc:
        raise SettingError(f"{KEY}.metaserver_ssl_ca_certs {ca!r} is not a CA bundle (PEM): {exc}") from None
    if not cert:
        return
    try:
        ctx.load_cert_chain(cert, key, password or None)
    except (ssl.SSLError, OSError) as exc:
        raise SettingError(
            f"{KEY}.metaserver_ssl_certfile {cert!r} with metaserver_ssl_keyfile {key!r} does not load (PEM "
            f"certificate and its key{', and the key password' if password else ''}): {exc}"
        ) from None


def client_tls_context(certfile: str, keyfile: str, password: str, ca_certs: str) -> ssl.SSLContext:
    """A client context verifying servers with ``ca_certs`` (empty: the system's CA store) and, with
    ``certfile``, presenting that certificate (mutual TLS)."""
    ctx = ssl.create_default_context(cafile=ca_certs or None)
    if certfile:
        ctx.load_cert_chain(certfile, keyfile or None, password or None)
    return ctx


def abort_timeout_s(env: Mapping[str, str]) -> float | None:
    """``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` in seconds, None when unset."""
    raw = env.get(ABORT_TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise SettingError(
            f"environment variable {ABORT_TIMEOUT_ENV}={raw!r} must be a number of seconds > 0 "
            "(how long P keeps a finished prefill's KV for D)"
        )
    return seconds


def hold_from_env(is_prefill: bool, values: dict[str, Any], env: Mapping[str, str]) -> None:
    """P's hold: ``room_timeout_s`` if given, else ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` if set."""
    seconds = abort_timeout_s(env)
    if seconds is None:
        return
    if "room_timeout_s" in values:
        if is_prefill:
            logger.info(
                "P keeps a finished prefill's KV %g s for D: %s.room_timeout_s, not %s=%g",
                values["room_timeout_s"],
                KEY,
                ABORT_TIMEOUT_ENV,
                seconds,
            )
        return
    values["room_timeout_s"] = seconds
    if is_prefill:
        logger.info(
            "P keeps a finished prefill's KV %g s for D: %s (%s.room_timeout_s not set)",
            seconds,
            ABORT_TIMEOUT_ENV,
            KEY,
        )


def check_qos(qos: Any) -> None:
    if isinstance(qos, bool) or not isinstance(qos, int) or not QOS_MIN <= qos <= QOS_MAX:
        raise SettingError(
            f"{KEY}.qos_priority must be an integer in {QOS_MIN}..{QOS_MAX} (HIXL channel QoS of the transfer's "
            f"initiator), got {qos!r}"
        )


# ----------------------------------------------------------------- engine start


def merged_resource_config(raw: str | None, qos: int) -> str:
    """``ASCEND_GLOBAL_RESOURCE_CONFIG``'s JSON with ``"comm_resource_config.qos"`` set to ``qos``."""
    check_qos(qos)
    data: Any = {}
    if raw is not None and raw.strip():
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise SettingError(
                f"environment variable {RESOURCE_CONFIG_ENV} is not valid JSON ({exc}); PDConnector merges "
                f"{KEY}.qos_priority into it: fix or unset it"
            ) from None
        if not isinstance(data, dict):
            raise SettingError(
                f"environment variable {RESOURCE_CONFIG_ENV} must be a JSON object, got {raw!r}; PDConnector merges "
                f"{KEY}.qos_priority into it"
            )
    data[QOS_KEY] = qos
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _env_int(env: Mapping[str, str], name: str, default: int, least: int) -> int:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        value = least - 1
    if value < least:
        raise SettingError(f"environment variable {name}={raw!r} must be an integer >= {least}")
    return value


def transfer_timeout_ms(env: Mapping[str, str]) -> int:
    """vLLM-Ascend 0.23's ``ASCEND_TRANSFER_TIMEOUT`` for an unset one, in ms.

    HCCL retransmits an RDMA packet after 4.096 us * 2**HCCL_RDMA_TIMEOUT, HCCL_RDMA_RETRY_CNT
    times; vLLM-Ascend waits that long (in whole ms) plus 3 s. Defaults 20 and 7: 33064 ms.
    """
    timeout = _env_int(env, RDMA_TIMEOUT_ENV, RDMA_TIMEOUT_DEFAULT, 0)
    retries = _env_int(env, RDMA_RETRY_ENV, RDMA_RETRY_DEFAULT, 0)
    wait_us = 4.096 * 2**timeout * retries
    return int(wait_us // 1000 + 3000)


def apply_transport_env(cfg: DisaggConfig, env: MutableMapping[str, str] | None = None) -> None:
    """On the ``ascend`` transport: the QoS and transfer timeout of vLLM-Ascend, before the engine starts.

    Every value is checked before the environment is changed.
    """
    if not cfg.backend_options.uses_hixl:
        return
    env = os.environ if env is None else env
    resource = merged_resource_config(env.get(RESOURCE_CONFIG_ENV), cfg.qos_priority)
    user_timeout = env.get(TRANSFER_TIMEOUT_ENV)
    if user_timeout is not None and user_timeout.strip():
        _env_int(env, TRANSFER_TIMEOUT_ENV, 0, 1)
        timeout = None
    else:
        timeout = transfer_timeout_ms(env)
    env[RESOURCE_CONFIG_ENV] = resource
    logger.info("Injected %s=%d into %s", QOS_KEY, cfg.qos_priority, RESOURCE_CONFIG_ENV)
    if timeout is None:
        logger.info("%s=%s kept (set by the user)", TRANSFER_TIMEOUT_ENV, user_timeout)
        return
    env[TRANSFER_TIMEOUT_ENV] = str(timeout)
    logger.info(
        "%s=%d ms (from %s=%s, %s=%s, as vLLM-Ascend)",
        TRANSFER_TIMEOUT_ENV,
        timeout,
        RDMA_TIMEOUT_ENV,
        env.get(RDMA_TIMEOUT_ENV, RDMA_TIMEOUT_DEFAULT),
        RDMA_RETRY_ENV,
        env.get(RDMA_RETRY_ENV, RDMA_RETRY_DEFAULT),
    )
