"""Draining an instance before it stops (SIGTERM on a launcher: `ProcessGroup`, `ManagedProcess.drain`).

A `Drainer` is called with a time bound and returns what happened (a short text for the log):

- `router_drainer`: asks the Router in front of the instance to drain it (`POST /instances/drain`,
  proxy/admin/drain.py: no new request goes there, a decoder's resumable streams move to another decoder,
  the answer once the instance holds nothing); the Router's generated admin token is read from its
  default path (proxy/access/admin_token.py) unless a token is given.
- `idle_drainer`: no Router to ask: waits until the instance's own `/metrics` shows nothing running
  or waiting and, on a prefiller, no room held (every pending push done).

`drain_all` runs the drainers of several processes at once, bounded, and never raises: a drain that
fails or runs out of time only means the process is stopped as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import httpx

from proxy.admin.drain import HELD_METRICS, held_counts

logger = logging.getLogger("launch.processes")

#: Default bound of the drain a SIGTERM starts (then the processes are stopped as before).
DRAIN_S = 60.0
POLL_S = 0.25

#: A process's drain: called with the seconds it may take, returns what happened.
Drainer = Callable[[float], str]


class _Draining(Protocol):
    label: str
    drain: Drainer | None


def router_drainer(router_url: str, role: str, host: str, port: int, token: str | None = None) -> Drainer:
    """Drain ``role`` instance ``host:port`` through the Router at ``router_url``."""

    def drain(bound_s: float) -> str:
        if token is not None:
            headers = {"Authorization": f"Bearer {token}"}
        else:
            from proxy.access.admin_token import admin_headers

            router_port = httpx.URL(router_url).port or 80
            try:
                headers = admin_headers(router_port)
            except OSError:
                headers = {}  # an --insecure-admin Router, or a token the launcher cannot read
        body = {"role": role, "host": host, "port": port, "timeout_s": max(0.1, bound_s - 1.0)}
        reply = httpx.post(
            f"{router_url}/instances/drain", json=body, headers=headers, timeout=bound_s + 5.0, trust_env=False
        )
        if reply.status_code not in (200, 504):
            return f"the Router answered HTTP {reply.status_code}: {reply.text[:200]}"
        return str(reply.json().get("message", reply.status_code))

    return drain


def idle_drainer(url: str, role: str) -> Drainer:
    """Wait until the instance at ``url`` holds nothing (its ``/metrics``)."""
    names = HELD_METRICS[role]

    def drain(bound_s: float) -> str:
        start = time.monotonic()
        deadline = start + bound_s
        held: dict[str, float] = {}
        while time.monotonic() < deadline:
            reply = httpx.get(f"{url}/metrics", timeout=5.0, trust_env=False)
            held = held_counts(reply.text, names) if reply.status_code == 200 else {}
            if not held:
                return f"no metrics to wait on (HTTP {reply.status_code})"
            if not any(v > 0 for v in held.values()):
                return f"idle after {time.monotonic() - start:.1f} s"
            time.sleep(POLL_S)
        return f"still holding {held} after {bound_s:.0f} s"

    return drain


def drain_all(procs: Sequence[_Draining], bound_s: float, say: Callable[[str], None]) -> None:
    """Run the drains of ``procs`` (those that have one) at once; return within ``bound_s`` (+1 s)."""
    drains = [p for p in procs if p.drain is not None]
    if not drains:
        return
    say(f"draining {', '.join(p.label for p in drains)} first (at most {bound_s:.0f} s)")
    start = time.monotonic()

    def run(proc: _Draining) -> None:
        assert proc.drain is not None
        try:
            say(f"{proc.label} drained: {proc.drain(bound_s)} ({time.monotonic() - start:.1f} s)")
        except Exception as exc:  # a drain only delays the stop: never let it block it
            say(f"{proc.label} drain failed ({type(exc).__name__}: {exc}); stopping it anyway")

    threads = [threading.Thread(target=run, args=(p,), daemon=True, name=f"drain-{p.label}") for p in drains]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, start + bound_s + 1.0 - time.monotonic()))
