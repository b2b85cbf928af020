"""The Router's kv_both flags (``--both-hosts``, ``--both-ports``, ``--both-bootstrap-ports``).

A kv_role kv_both instance (pd_connector.config) prefills for another instance's decode and decodes
what another prefilled, per request. The Router puts it in both pools, one
:class:`proxy.router_config.Backend` per role, and never pairs it with itself
(:class:`proxy.upstream.pool.BackendPool`).
"""

from __future__ import annotations

import argparse

from pd_connector.kv_params import DEFAULT_BOOTSTRAP_PORT
from proxy.router_config import Backend


def add_both_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--both-hosts",
        nargs="+",
        metavar="HOST",
        help="hosts of kv_role kv_both instances: each prefills and decodes, per request, and joins both pools "
        "(never paired with itself: a request whose only free pair would be one instance is served by it alone)",
    )
    add("--both-ports", nargs="+", type=int, metavar="PORT", help="HTTP ports of the kv_both instances")
    add(
        "--both-bootstrap-ports",
        nargs="+",
        type=int,
        metavar="PORT",
        help="bootstrap-server port of each kv_both instance (its kv_connector_extra_config.bootstrap_port); one "
        f"value applies to all (default: {DEFAULT_BOOTSTRAP_PORT})",
    )


def both_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Backend]:
    """The kv_both instances, as their prefill side (``both=True``); errors exit with code 2."""
    hosts, ports, bootstrap = args.both_hosts or [], args.both_ports or [], args.both_bootstrap_ports or []
    if not hosts and not ports:
        if bootstrap:
            parser.error("--both-bootstrap-ports needs --both-hosts and --both-ports")
        return []
    if len(hosts) != len(ports):
        parser.error(f"--both-hosts has {len(hosts)} values but --both-ports has {len(ports)}")
    if any(not host.strip() for host in hosts):
        parser.error("--both-hosts: empty host name")
    if len(bootstrap) not in (0, 1, len(hosts)):
        parser.error(
            f"--both-bootstrap-ports has {len(bootstrap)} values; give one, or one per kv_both instance ({len(hosts)})"
        )
    bootstrap = bootstrap * len(hosts) if len(bootstrap) == 1 else bootstrap or [DEFAULT_BOOTSTRAP_PORT] * len(hosts)
    for flag, values in (("--both-ports", ports), ("--both-bootstrap-ports", bootstrap)):
        for port in values:
            if not 1 <= port <= 65535:
                parser.error(f"{flag}: port {port} is not in 1..65535")
    pairs = list(zip(hosts, ports, strict=True))
    if len(set(pairs)) != len(pairs):
        parser.error("--both-hosts/--both-ports: the same instance is listed twice")
    return [
        Backend("prefill", host, port, bport, both=True) for (host, port), bport in zip(pairs, bootstrap, strict=True)
    ]
