"""The Router's application state: :class:`Router`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from proxy.access.tls import client_context
from proxy.admin.drain import Drains
from proxy.admin.instances import Membership
from proxy.planning.live import ModelSet, PathChooser
from proxy.request.rooms_in_flight import RoomsInUse
from proxy.router_config import RouterConfig
from proxy.router_metrics import RouterMetrics
from proxy.strategies.prefill_watch import PrefillWatch
from proxy.upstream.calls import check_all
from proxy.upstream.http1 import Http1Pool
from proxy.upstream.pair_refusals import PairRefusals
from proxy.upstream.pool import BackendPool

logger = logging.getLogger("proxy")

#: With the background checks off (``--health-interval 0``), the Router's ``/health`` checks the
#: backends itself, one round at a time shared by every caller, at most once this many seconds.
ON_DEMAND_HEALTH_S = 2.0


class Router:
    """Configuration, backend pool, metrics, the one HTTP client to the backends, membership."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        tls_out = config.backend_tls is not None
        self.pool = BackendPool(config.prefillers, config.decoders, config.routing, config.routing_options, tls=tls_out)
        self.metrics = RouterMetrics(self.pool)
        #: Each request's path: P prefills and pushes, or D prefills (``--path-policy``).
        paths = config.paths
        models = ModelSet.load(paths.model_file)
        self.paths = PathChooser(paths.policy, paths.options, models, self.metrics, paths.block_tokens)
        self.pool.on_remove.append(self.paths.forget)
        #: Every call to a backend (P and D requests, health checks, models, admin calls).
        tls = client_context(config.backend_tls) if config.backend_tls else None
        self.http = Http1Pool(config.connect_timeout, ssl_context=tls)
        #: Liveness of the prefillers first-token requests wait on (``first_token``).
        self.prefill_watch = PrefillWatch(self.http, config.health_timeout)
        self.pair_refusals = PairRefusals()
        #: Tasks the Router keeps references to until they end (detached prefills, aborts, ...).
        self.tasks: set[asyncio.Task[Any]] = set()
        #: Instances added and removed at run time (``/instances/...``).
        self.membership = Membership(self)
        #: Decoders' movable streams and drains in progress (``/instances/drain``).
        self.drains = Drains(self)
        #: Rooms of the requests in flight (one request per room).
        self.rooms = RoomsInUse()
        #: Set once the health loop's first round is recorded (``/health`` waits for it).
        self.first_health_round = asyncio.Event()
        self._on_demand: asyncio.Task[None] | None = None
        self._on_demand_at = float("-inf")

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a task referenced until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self.keep(task)
        return task

    def keep(self, task: asyncio.Task[Any]) -> None:
        """Reference ``task`` until it ends (so it is not garbage-collected while running)."""
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- lifecycle -------------------------------------------------------------------------

    async def startup(self, _app: web.Application) -> None:
        if self.config.health_interval > 0:
            self.spawn(self._health_loop())

    async def cleanup(self, _app: web.Application) -> None:
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=2.0)
        self.http.close()

    async def _health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:  # pragma: no cover (check_all does not raise)
                logger.exception("health check round failed")
            self.first_health_round.set()
            await asyncio.sleep(self.config.health_interval)

    async def health_known(self) -> None:
        """Return once the pool's health is what the checks found, without a probe of this caller's
        own: the health loop's first round (waited for, once), or with the loop off a round shared
        by every caller and run at most every ``ON_DEMAND_HEALTH_S`` seconds."""
        if self.config.health_interval > 0:
            if not self.first_health_round.is_set():
                await self.first_health_round.wait()
            return
        now = asyncio.get_running_loop().time()
        task = self._on_demand
        if task is None or (task.done() and now - self._on_demand_at >= ON_DEMAND_HEALTH_S):
            self._on_demand_at = now
            self._on_demand = task = self.spawn(self.check_health())
        await asyncio.shield(task)

    async def check_health(self) -> None:
        """Health-check every backend now and record the results."""
        await check_all(self.http, self.pool, self.config.health_timeout)
