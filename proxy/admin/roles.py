"""Role change without a restart: ``POST /instances/role`` (:class:`RoleChanges`).

A vLLM instance started with kv_role ``kv_both`` (pd_connector.config: each request is P or D by its
``kv_transfer_params``) may serve the Router as a prefiller, a decoder or both (``--both-hosts``, or
``/instances/add`` with ``"kv_role": "kv_both"``). This call moves such an instance between the pools
while it runs; the instance itself is not touched (its kv_role stays kv_both):

``{"host": H, "port": P, "serves": "prefill" | "decode" | "both", "timeout_s": T?, "bootstrap_port": B?}``

1. the role it takes up joins first (a prefiller with its bootstrap port: ``bootstrap_port``, else the
   one it had as a prefiller, else 18800), so the pool never shrinks below what it was;
2. the role it gives up is drained by :mod:`proxy.admin.drain`: as a prefiller it gets no new prefill and
   the call waits for its prefills in flight and for its rooms' KV to be loaded
   (``vllm:pd_kv_rooms_held`` 0); as a decoder its resumable streams move to other decoders (kv_both
   has no ``migration``, so by replay: P prefills the prompt and the tokens sent) and the others
   finish in place. No request fails for it. The instance's other role keeps serving meanwhile, so
   the drain reads only the metrics of the side that leaves (:func:`proxy.admin.drain.held_metric_names`).

Refused: an instance the Router does not know (404), one with a fixed role (kv_producer /
kv_consumer, 409: only a kv_both instance can serve the other side), giving up the last active
instance of a role (409), a second change of the same instance while one runs (409), and ``--workers``
above 1 (409: a pool change would reach one worker only). The answer is 200 once the instance serves
its new roles and holds nothing of the old one, 504 when a drain's ``timeout_s`` passed first (the
instance has left that pool all the same).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Literal

from pd_connector.kv_params import DEFAULT_BOOTSTRAP_PORT
from proxy.admin.drain import DEFAULT_DRAIN_TIMEOUT_S, DrainOutcome
from proxy.errors import INVALID_REQUEST, NOT_FOUND, RouterError
from proxy.router_config import ROLES, Backend, Role

if TYPE_CHECKING:
    from proxy.router_state import Router
    from proxy.upstream.pool import BackendState

logger = logging.getLogger("proxy")

Serves = Literal["prefill", "decode", "both"]
SERVES: dict[str, tuple[Role, ...]] = {"prefill": ("prefill",), "decode": ("decode",), "both": ("prefill", "decode")}
#: The error type of a refused role change (a conflict with what the instance is or does).
CONFLICT = "conflict_error"


def kv_both(backend: Backend) -> bool:
    """Whether ``backend`` is one side of a kv_role kv_both instance."""
    return backend.both


def parse_role_change(payload: Any) -> tuple[str, int, Serves, float, int | None]:
    """``(host, port, serves, timeout_s, bootstrap_port)`` of a ``/instances/role`` body."""
    if not isinstance(payload, dict):
        raise RouterError(400, "request body must be a JSON object", INVALID_REQUEST)
    host, port = payload.get("host"), payload.get("port")
    if not isinstance(host, str) or not host.strip():
        raise RouterError(400, f"'host' must be a non-empty string, got {host!r}", INVALID_REQUEST, "host")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise RouterError(400, f"'port' must be a port number in 1..65535, got {port!r}", INVALID_REQUEST, "port")
    serves = payload.get("serves")
    if serves not in SERVES:
        raise RouterError(
            400, f"'serves' must be 'prefill', 'decode' or 'both', got {serves!r}", INVALID_REQUEST, "serves"
        )
    timeout = payload.get("timeout_s", DEFAULT_DRAIN_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise RouterError(400, f"'timeout_s' must be a number > 0, got {timeout!r}", INVALID_REQUEST, "timeout_s")
    bootstrap = payload.get("bootstrap_port")
    if bootstrap is not None and (
        isinstance(bootstrap, bool) or not isinstance(bootstrap, int) or not 1 <= bootstrap <= 65535
    ):
        raise RouterError(
            400, f"'bootstrap_port' must be a port number in 1..65535, got {bootstrap!r}", INVALID_REQUEST,
            "bootstrap_port",
        )  # fmt: skip
    return host.strip(), port, serves, float(timeout), bootstrap


class RoleChanges:
    """The role changes of kv_both instances (one per Router; one change per instance at a time)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        #: Per kv_both instance (host, port): its Backend per role, as last seen (a role it left comes back so).
        self._sides: dict[tuple[str, int], dict[Role, Backend]] = {}
        self._running: set[tuple[str, int]] = set()

    def _states(self, host: str, port: int) -> dict[Role, BackendState]:
        """The instance's states in the pool (active or draining), by role."""
        found = {role: self.router.pool.find(role, host, port) for role in ROLES}
        return {role: state for role, state in found.items() if state is not None}

    def _refuse(self, message: str, status: int = 409, param: str | None = None) -> RouterError:
        return RouterError(status, message, CONFLICT if status == 409 else NOT_FOUND, param)

    async def change(
        self, host: str, port: int, serves: Serves, timeout: float, bootstrap_port: int | None
    ) -> tuple[int, dict[str, Any]]:
        """Make the instance at ``host:port`` serve ``serves``; the answer's status and body."""
        router = self.router
        if router.config.workers > 1:
            raise self._refuse(f"--workers {router.config.workers}: a pool change would reach one worker only")
        states = self._states(host, port)
        sides = self._sides.setdefault((host, port), {})
        for role, state in states.items():
            if kv_both(state.backend):
                sides[role] = state.backend
        if not states and not sides:
            self._sides.pop((host, port), None)
            raise self._refuse(f"unknown instance {host}:{port}", 404, "host")
        if not sides:
            name = next(iter(states.values())).backend.name
            raise self._refuse(
                f"{name} has a fixed role (kv_producer or kv_consumer): only an instance started with kv_role "
                "kv_both can serve as another role (add it with --both-hosts, or /instances/add with "
                '"kv_role": "kv_both")',
                param="serves",
            )
        key = (host, port)
        if key in self._running:
            raise self._refuse(f"a role change of {host}:{port} is in progress")
        wanted = SERVES[serves]
        active = {role for role, state in states.items() if not state.draining}
        leaving = [role for role in ROLES if role in active and role not in wanted]
        joining = [role for role in ROLES if role in wanted and role not in active]
        for role in leaving:
            others = [s for s in router.pool.active[role] if s is not states[role]]
            if not others:
                kind = "prefiller" if role == "prefill" else "decoder"
                raise self._refuse(
                    f"{host}:{port} is the only active {kind}: add another before it stops serving as one"
                )
        self._running.add(key)
        start = time.monotonic()
        try:
            joined = {role: await self._join(sides, role, host, port, bootstrap_port) for role in joining}
            reports = await asyncio.gather(
                *(router.drains.drain(states[role], role, host, port, timeout) for role in leaving)
            )
        finally:
            self._running.discard(key)
        drained = [r.record() for r in reports]
        ok = all(r.outcome is DrainOutcome.DRAINED for r in reports)
        message = (
            f"{host}:{port} serves {serves}: joined {', '.join(joining) or 'nothing'}, left "
            f"{', '.join(f'{r.role} ({r.outcome.value})' for r in reports) or 'nothing'} in "
            f"{time.monotonic() - start:.3f} s"
        )
        logger.info("instances/role: %s", message)
        body = {"message": message, "serves": serves, "joined": joined, "drained": drained}
        return (200 if ok else 504), {**body, **router.membership.listing()}

    async def _join(
        self, sides: dict[Role, Backend], role: Role, host: str, port: int, bootstrap_port: int | None
    ) -> str:
        """Add the instance's ``role`` side to the pool (re-activated if it still drains)."""
        backend = sides.get(role)
        if role == "prefill":
            port_b = (
                bootstrap_port or (backend.bootstrap_port if backend is not None else None) or DEFAULT_BOOTSTRAP_PORT
            )
            backend = Backend("prefill", host, port, port_b, backend.bootstrap_host if backend else None, both=True)
        elif backend is None:
            backend = Backend("decode", host, port, both=True)
        sides[role] = backend
        return await self.router.membership.add(backend)
