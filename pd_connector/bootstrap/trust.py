"""Which bootstrap addresses a decode instance may contact (``trusted_bootstrap_hosts``).

A request names its prefill deployment's bootstrap server (``kv_transfer_params.bootstrap_host``);
without a check, anyone who reaches D makes D connect to any host and port, and hands it D's bearer
token. D contacts only hosts on its list:

- an IPv4/IPv6 address or network (``10.0.0.0/8``, ``fd00::/8``, ``192.0.2.7``): matches IP literals
  inside it (a host name is not resolved to be compared with a network);
- a host name (``prefill-0.pd.svc``): matches that name exactly (case-insensitive);
- ``*``: every host (an explicit opt-in).

Default (the key unset): what D was configured with, nothing a request brings:
D's own ``bootstrap_host``; loopback (``127.0.0.0/8``, ``::1``, ``localhost``) only when D's own
deployment is on loopback (its ``local_ip`` is a loopback address: P and D share the host). A D on a
cluster address does not trust loopback by default, not even a loopback ``bootstrap_host`` left at its
default: any local user can listen on a loopback port. Deployments with several prefill hosts list
them, or their network.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

ANY = "*"
LOOPBACK_ENTRIES = ("127.0.0.0/8", "::1", "localhost")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class TrustSettings(Protocol):
    """What a decode config says about the bootstrap servers it may contact (``DisaggConfig``'s keys)."""

    @property
    def trusted_bootstrap_hosts(self) -> tuple[str, ...]: ...

    @property
    def bootstrap_host(self) -> str: ...

    @property
    def local_ip(self) -> str: ...


class TrustError(ValueError):
    """An entry of ``trusted_bootstrap_hosts`` is neither a network, an address, a host name nor ``*``."""


def split_addr(addr: str) -> str:
    """The host of a ``host:port`` / ``[v6]:port`` bootstrap address (brackets dropped)."""
    if addr.startswith("["):
        return addr[1 : addr.index("]")] if "]" in addr else addr[1:]
    return addr.rsplit(":", 1)[0] if addr.count(":") == 1 else addr


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        return ipaddress.ip_address(bare.split("%", 1)[0])  # a zone id does not change the address
    except ValueError:
        return None


@dataclass(frozen=True)
class TrustedHosts:
    """The hosts a decode instance may ask for routes (immutable, cheap to check)."""

    networks: tuple[Network, ...] = ()
    names: frozenset[str] = frozenset()
    any_host: bool = False

    @classmethod
    def parse(cls, entries: Iterable[str], key: str = "trusted_bootstrap_hosts") -> TrustedHosts:
        networks: list[Network] = []
        names: set[str] = set()
        any_host = False
        for raw in entries:
            entry = raw.strip()
            if entry == ANY:
                any_host = True
                continue
            bare = entry[1:-1] if entry.startswith("[") and entry.endswith("]") else entry
            try:
                networks.append(ipaddress.ip_network(bare, strict=False))
                continue
            except ValueError:
                pass
            ok = 0 < len(bare) <= 253 and all(c.isascii() and (c.isalnum() or c in "-._") for c in bare)
            if not ok or ":" in bare or "/" in bare:
                raise TrustError(
                    f"kv_connector_extra_config.{key}: {raw!r} is not an IP address, a network (CIDR), a host name or '*'"
                )
            names.add(bare.lower())
        return cls(tuple(networks), frozenset(names), any_host)

    @classmethod
    def default(cls, bootstrap_host: str, local_ip: str = "127.0.0.1") -> TrustedHosts:
        """D's configured ``bootstrap_host``, plus loopback only when ``local_ip`` is loopback."""
        on_loopback = is_loopback_host(local_ip)
        entries = list(LOOPBACK_ENTRIES) if on_loopback else []
        if on_loopback or not is_loopback_host(bootstrap_host):
            entries.append(bootstrap_host)
        return cls.parse(entries)

    def allows(self, host: str) -> bool:
        """Whether D may contact a bootstrap server on ``host`` (an IP literal or a name)."""
        if self.any_host:
            return True
        ip = _ip(host)
        if ip is None:
            return host.lower().rstrip(".") in self.names
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip.version == net.version and ip in net for net in self.networks)

    def describe(self) -> str:
        if self.any_host:
            return "any host"
        return ", ".join([*(str(n) for n in self.networks), *sorted(self.names)]) or "none"


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an IP literal, maybe bracketed, or ``localhost``) is this machine only."""
    if host.lower().rstrip(".") == "localhost":
        return True
    ip = _ip(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip is not None and ip.is_loopback


def trusted_hosts_of(cfg: TrustSettings) -> TrustedHosts:
    """The bootstrap hosts this (decode) instance may contact: the configured list, else the default."""
    if cfg.trusted_bootstrap_hosts:
        return TrustedHosts.parse(cfg.trusted_bootstrap_hosts)
    return TrustedHosts.default(cfg.bootstrap_host, cfg.local_ip)
