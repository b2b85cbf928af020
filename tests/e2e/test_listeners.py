"""Every socket P, D and the Router listen on binds their address, except Mooncake's documented two.

Run against the session P/D stack (all on loopback): the listening sockets of each instance's whole
process tree (API server, EngineCore, workers) come from /proc. A wildcard bind (0.0.0.0, ::) fails the
test unless it is one of the listeners the instance's log names as Mooncake's transfer engine's
(`pd_connector.transfer.mooncake`): this Mooncake version binds every interface whatever `local_ip`,
the known exposure docs/security.md documents (and tells to firewall). Those must be exactly two per
rank (RPC/handshake port, TCP data port), in Mooncake's port range.
"""

from __future__ import annotations

import re

import pytest

from launch.processes import PDStack
from tests.support.netns import listeners, mooncake_listeners, undocumented_wildcards

pytestmark = pytest.mark.e2e

#: Mooncake's default port range (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT); the stack does not change it.
MOONCAKE_PORTS = range(15000, 17001)
_RANK_LINE = re.compile(r"KV transfer manager \((?:prefill|decode)\) listening on tcp://(\S+):(\d+),")


def test_every_listener_binds_the_instance_address_but_mooncakes(pd_stack: PDStack) -> None:
    table = []
    for proc, http_port in ((pd_stack.prefill, pd_stack.prefill_port), (pd_stack.decode, pd_stack.decode_port)):
        wild, socks = undocumented_wildcards(proc.pid, proc.log_path)
        table += [f"{proc.name} pid {s.pid}: {s.where}" for s in socks]
        assert not wild, f"{proc.name}: wildcard listeners nobody documented: {[s.where for s in wild]}"
        mooncake = mooncake_listeners(proc.log_path)
        assert len(mooncake) == 2, f"{proc.name}: Mooncake's listeners in its log: {mooncake}"
        bound = {(s.host, s.port) for s in socks}
        for host, port in mooncake:
            assert (host, port) in bound and port in MOONCAKE_PORTS, (proc.name, host, port)
        own = {(pd_stack.host, http_port)}
        rank = _RANK_LINE.search(proc.log_path.read_text(errors="replace"))
        assert rank is not None, f"{proc.name}: no rank endpoint in its log"
        own.add((rank.group(1), int(rank.group(2))))
        if proc is pd_stack.prefill:
            own.add((pd_stack.host, pd_stack.bootstrap_port))
        assert own <= bound, f"{proc.name}: expected listeners {own - bound} missing from {sorted(bound)}"
        others = [s.where for s in socks if (s.host, s.port) not in mooncake and s.host != pd_stack.host]
        assert not others, f"{proc.name}: listeners off the instance's address {pd_stack.host}: {others}"
    router = listeners(pd_stack.router.pid)
    table += [f"router pid {s.pid}: {s.where}" for s in router]
    assert [(s.host, s.port) for s in router] == [(pd_stack.host, pd_stack.router_port)], router
    print("\n".join(["listening sockets:", *table]))
