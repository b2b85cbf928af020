"""Where the control plane may listen without a token (closed by default).

A rank's ZMQ socket and P's bootstrap server bind ``local_ip``; P's ranks register at
``bootstrap_host``. Without a shared token (``auth_token_file`` / ``auth_token_env``) anyone who
reaches those addresses can register ranks and forge handshakes, so:

- no token, ``local_ip`` and (on P) ``bootstrap_host`` loopback: runs, and says at start-up that
  it serves this host only;
- no token and a non-loopback one of them: start-up is refused with a message naming the key to
  set (refused rather than quietly bound to loopback: a multi-node deployment that cannot be reached
  would only fail later and less clearly);
- ``insecure: true``: runs open on purpose, with a warning line;
- a token: runs; every frame and call is checked.
"""

from __future__ import annotations

import ipaddress
from typing import NamedTuple

from pd_connector.auth import token_of
from pd_connector.config import ConfigError, DisaggConfig


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP literal, maybe bracketed, or a name) is this machine only."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if bare.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        return False  # any other host name may resolve to a cluster address


class Exposure(NamedTuple):
    """What a rank logs at start-up about its control plane; ``open``: reachable without a token."""

    line: str
    open: bool = False


def exposure_of(cfg: DisaggConfig) -> Exposure:
    """The start-up line about the control plane's reach; raises ConfigError if it would be open by accident."""
    tls = "TLS" if cfg.bootstrap_ssl_certfile else "plain HTTP"
    if token_of(cfg) is not None:
        return Exposure(
            f"PDConnector control plane: shared token set (every ZMQ frame and bootstrap call checked); "
            f"ZMQ and bootstrap server bind {cfg.local_ip} (bootstrap over {tls})"
        )
    exposed = [("local_ip", cfg.local_ip)]
    if cfg.is_prefill:
        exposed.append(("bootstrap_host", cfg.bootstrap_host))
    public = [(key, host) for key, host in exposed if not is_loopback(host)]
    if not public:
        return Exposure(
            f"PDConnector control plane: no auth token, so ZMQ and the bootstrap server bind loopback "
            f"{cfg.local_ip} only (this host); to serve other hosts set kv_connector_extra_config.auth_token_file "
            "or auth_token_env (the same token on every P and D), or insecure: true"
        )
    names = ", ".join(f"{key} {host}" for key, host in public)
    if cfg.insecure:
        return Exposure(
            f"PDConnector control plane: insecure: true, NO auth token on {names}: anyone who reaches it can "
            "register ranks and forge handshakes; set kv_connector_extra_config.auth_token_file or auth_token_env",
            open=True,
        )
    raise ConfigError(
        f"PDConnector: kv_connector_extra_config {names} is not loopback but no auth token is set: set "
        "kv_connector_extra_config.auth_token_file or auth_token_env (the same token on every P and D), "
        "or insecure: true to run an unauthenticated control plane on purpose"
    )
