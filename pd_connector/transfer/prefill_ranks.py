"""D: which P ranks serve this D rank's part of a room, and what bounds their writes.

``PrefillRanks.resolve`` reads the prefill deployment's route from its bootstrap server (cached; a busy or
still-starting prefill gets a few more tries within the KV wait), checks it fits this rank (``compat``,
``peer_sizes``, ``layouts.pp``), picks the room's DP rank (the job's, the only one, or the one P registered
for the room; none yet: ``DpRankPending``, the load parks in ``dp_wait``) and returns the P ranks to ask:
in every pipeline stage holding one of this rank's layers, the TP ranks ``layouts.tp.decode_contacts``
names. Each rank's route entry carries what bounds its writes (``RankInfo.batch_stall_s`` and
``peer_timeout_s``, from its registration): the load's wait after it stops comes from those
(``loads.timing_of``), not from D's own transport.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pd_connector import messages as proto
from pd_connector.ascend.peer_sizes import sizes_mismatch
from pd_connector.bootstrap.client import BootstrapBusy, BootstrapError, RouteCache
from pd_connector.compat import route_mismatch
from pd_connector.config import PREFILL, DisaggConfig
from pd_connector.layouts.pp import partition_mismatch, stages_for
from pd_connector.layouts.regions import LayoutError
from pd_connector.layouts.tp import decode_contacts
from pd_connector.metadata import RecvJob
from pd_connector.transfer.channel import zmq_host
from pd_connector.transfer.context import RankSpec
from pd_connector.transfer.dp_wait import DpRankPending
from pd_connector.transfer.loads import PeerTiming, timing_of
from pd_connector.transfer.wire_checks import check_endpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Asked:
    """The P ranks a load asks: endpoint -> rank number (pp * P's TP size + tp), P's TP size, and the
    largest bounds on their writes (``loads.timing_of``)."""

    endpoints: dict[str, int]
    p_tp: int
    timing: PeerTiming


class PrefillRanks:
    def __init__(self, cfg: DisaggConfig, spec: RankSpec, routes: RouteCache) -> None:
        self._cfg = cfg
        self._spec = spec
        self._routes = routes

    def resolve(self, job: RecvJob) -> Asked:
        """The P ranks holding this rank's part of ``job``'s room. Raises BootstrapError (no route, a rank
        not registered), LayoutError (P does not fit), DpRankPending (the room's DP rank is not known yet)."""
        route = self._route_with_retries(job)
        spec = self._spec
        problem = route_mismatch(route, job.bootstrap_addr, spec.block_size, spec.kv_dtype, spec.num_layers, spec.model)
        what = f"the prefill deployment at {job.bootstrap_addr}"
        problem = problem or sizes_mismatch(
            PREFILL, self._cfg.prefill, what, route.dp_size, route.attn_tp_size, route.pp_size
        )
        partition = self._cfg.prefill.pp_layer_partition if self._cfg.prefill is not None else None
        firsts = [first for first, _ in route.stage_layers] if route.pp_size > 1 else [0]
        problem = problem or partition_mismatch(PREFILL, partition, what, firsts)
        if problem is not None:
            raise LayoutError(problem)
        ranks = self.ranks(job, route, self._prefill_dp_rank(job, route))
        endpoints = {endpoint: number for endpoint, (number, _) in ranks.items()}
        timing = timing_of(self._cfg, [info for _, info in ranks.values()])
        return Asked(endpoints, route.attn_tp_size, timing)

    def contacts(self, job: RecvJob, route: proto.Route, dp_rank: int) -> dict[str, int]:
        """The P ranks of DP rank ``dp_rank`` holding this rank's part of the room (endpoint -> rank number)."""
        return {endpoint: number for endpoint, (number, _) in self.ranks(job, route, dp_rank).items()}

    def ranks(self, job: RecvJob, route: proto.Route, dp_rank: int) -> dict[str, tuple[int, proto.RankInfo]]:
        """As ``contacts``, each with its route entry."""
        spec = self._spec
        stages = stages_for(route, spec.region_layers or range(spec.num_layers), job.bootstrap_addr)
        tp_ranks = decode_contacts(
            spec.heads,
            route.attn_tp_size,
            spec.tp_size,
            spec.tp_rank,
            is_mla=spec.use_mla,
            spread=job.room % route.attn_tp_size,
        )
        found: dict[str, tuple[int, proto.RankInfo]] = {}
        for pp in stages:
            for tp in tp_ranks:
                info = route.rank(dp_rank, 0, tp, pp)
                if info is None:
                    name = f"dp={dp_rank} tp={tp}" + (f" pp={pp}" if route.pp_size > 1 else "")
                    raise BootstrapError(f"prefill rank {name} is not registered at {job.bootstrap_addr}")
                endpoint = check_endpoint(f"tcp://{zmq_host(info.rank_ip)}:{info.rank_port}")
                found[endpoint] = (pp * route.attn_tp_size + tp, info)
        return found

    def _route_with_retries(self, job: RecvJob) -> proto.Route:
        """P's topology; a busy or still-starting prefill gets a few more tries within the KV wait."""
        deadline = time.monotonic() + min(self._cfg.kv_wait_timeout_s / 2, 30.0)
        while True:
            try:
                return self._routes.get(job.bootstrap_addr)
            except BootstrapBusy as exc:
                if time.monotonic() + 0.5 >= deadline:
                    raise
                logger.warning("room=%d req=%s: %s; retrying", job.room, job.req_id, exc)
                time.sleep(0.5)

    def _prefill_dp_rank(self, job: RecvJob, route: proto.Route) -> int:
        if job.prefill_dp_rank is not None:
            if job.prefill_dp_rank >= route.dp_size:
                raise BootstrapError(f"prefill_dp_rank {job.prefill_dp_rank} but prefill has dp_size {route.dp_size}")
            return job.prefill_dp_rank
        if route.dp_size == 1:
            return 0
        dp = self._routes.query_dp_rank(job.bootstrap_addr, job.room)  # one look; then dp_wait looks
        if dp is None:
            raise DpRankPending(job.room)
        return dp
