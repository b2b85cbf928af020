"""D2RH (decode to remote host, vLLM-Ascend's ``MooncakeD2RHConnectorV1``): D's scheduler side.

A D request's prompt KV first lands in D's host KV pool (``host_pool``: pinned host blocks, indexed
here by vLLM block hash), and only then does the request get device blocks and a host -> device copy.
So no device block waits on the network, and prefixes staged earlier are loaded from the host pool
without asking P for them. Pure bookkeeping, no I/O: the worker side (``host_kv``) stages and copies.

Per request (``D2RHState``):

- vLLM asks ``get_num_new_matched_tokens``; the leading blocks cached in the pool are host hits. When
  the hits cover every block P would send (a partial last block is left to D to compute), the
  request is HOST_READY at once and P's room is released. Otherwise the missing blocks get fresh
  host blocks and a staging job (a ``RecvJob`` whose destination ids are host block ids) goes to
  the workers: STAGING, and vLLM hears ``None`` (ask again next step; the request waits holding no
  device block). No room in the pool: WAITING_POOL (nothing held) until ``wait_s``, then D
  computes the prompt itself and P's room is released.
- Each worker reports its staging outcome (``D2RHWorkerMeta.staged``, after every P rank it asked
  stopped writing: the device path's CANCELLING guard); once every rank did, the staged full
  blocks are cached under their hashes (HOST_READY), or on a failure dropped (STAGE_FAILED).
- HOST_READY / STAGE_FAILED: vLLM hears the count, allocates device blocks and a ``HostLoad`` goes to
  the workers (LOADING): they copy host -> device (a failed one is reported failed, so vLLM applies
  ``kv_load_failure_policy``), then report ``finished_recving`` and ``D2RHWorkerMeta.loaded``; the
  host blocks are unpinned when every rank reported the copy done.
- A request that ends while STAGING is ORPHANED: its host blocks are freed (or cached, if the
  staging succeeded) only when its staging ended, so nothing is written into a freed host block.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pd_connector.d2rh.host_pool import HostPool
from pd_connector.kv_params import DecodeParams
from pd_connector.metadata import HostLoad, RecvJob
from pd_connector.vllm_lines.bases import KVConnectorWorkerMetadata

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class D2RHState(enum.Enum):
    WAITING_POOL = "waiting_pool"  # no room in the host pool yet; holds nothing
    STAGING = "staging"  # P pushes into host blocks
    HOST_READY = "host_ready"  # every block the request loads is in the host pool
    STAGE_FAILED = "stage_failed"  # the staging failed: vLLM gets a failed load once it allocated
    LOADING = "loading"  # host -> device copy on the workers
    ORPHANED = "orphaned"  # the request ended while staging: blocks freed when the staging ends


@dataclass
class D2RHWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: staging outcomes (req -> [ranks, ranks failed]) and copies done."""

    staged: dict[str, list[int]] = field(default_factory=dict)
    loaded: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, D2RHWorkerMeta):
            for rid, (ranks, failed) in other.staged.items():
                mine = self.staged.setdefault(rid, [0, 0])
                mine[0] += ranks
                mine[1] += failed
            for rid, ranks in other.loaded.items():
                self.loaded[rid] = self.loaded.get(rid, 0) + ranks
        return self

    def __bool__(self) -> bool:
        return bool(self.staged or self.loaded)


@dataclass
class _Entry:
    req_id: str
    params: DecodeParams
    start: int  # first block the host pool covers (D's local prefix ends there)
    end_tokens: int  # the load ends at this token (P's tokens, or the hit blocks' end)
    hashes: list[Hashable | None]  # of blocks start.. (None: no hash, never cached)
    state: D2RHState
    pinned: list[int] = field(default_factory=list)  # host blocks of blocks start.. (hits, then staged)
    staged: list[int] = field(default_factory=list)
    hits: int = 0
    deadline: float = 0.0
    ranks: int = 0
    failed: int = 0
    load_from: int = 0  # LOADING: vLLM's computed tokens when it allocated


class D2RHScheduler:
    def __init__(self, pool: HostPool, block_size: int, ranks: int, wait_s: float) -> None:
        self.pool = pool
        self.block_size = block_size
        self.ranks = max(1, ranks)
        self.wait_s = wait_s
        self._entries: dict[str, _Entry] = {}
        self._stages: list[RecvJob] = []
        self._loads: list[HostLoad] = []
        self._releases: list[tuple[str, DecodeParams]] = []  # P rooms to release (no P blocks wanted)

    def knows(self, rid: str) -> bool:
        return rid in self._entries

    def state(self, rid: str) -> D2RHState | None:
        entry = self._entries.get(rid)
        return entry.state if entry is not None else None

    # ------------------------------------------------------------------ vLLM asks

    def begin(self, request: Request, params: DecodeParams, computed: int, covered: int) -> tuple[int | None, bool]:
        """A new D request: P prefilled ``covered`` tokens, D's prefix cache holds ``computed``."""
        bs = self.block_size
        start, end = computed // bs, -(-covered // bs)
        hashes = [self._hash(request, i, covered) for i in range(start, end)]
        entry = _Entry(request.request_id, params, start, covered, hashes, D2RHState.WAITING_POOL)
        self._entries[entry.req_id] = entry
        hits = self.pool.hits(hashes)
        full = covered // bs - start
        if hits > 0 and hits >= full:  # every full block is in the host pool: P is not asked
            entry.end_tokens = (start + hits) * bs if hits < len(hashes) else covered
            got = self.pool.acquire(hashes[:hits], 0)
            assert got is not None
            entry.pinned, entry.hits, entry.state = got[0], hits, D2RHState.HOST_READY
            self._releases.append((entry.req_id, entry.params))
            logger.info(
                "room=%d req=%s: %d blocks from D's host pool, prefill not asked", params.room, entry.req_id, hits
            )
            return self.poll(request, computed)
        entry.deadline = time.monotonic() + self.wait_s
        return self._try_stage(entry, hits, request, computed)

    def poll(self, request: Request, computed: int) -> tuple[int | None, bool]:
        """vLLM asks again about a request it was told ``None`` (or that is ready)."""
        entry = self._entries[request.request_id]
        if entry.state is D2RHState.WAITING_POOL:
            return self._try_stage(entry, self.pool.hits(entry.hashes), request, computed)
        if entry.state in (D2RHState.STAGING, D2RHState.ORPHANED):
            return None, False
        if entry.state is D2RHState.LOADING:
            return 0, False
        if computed < entry.start * self.block_size or entry.end_tokens <= computed:
            logger.info("req=%s: D's prefix cache changed under its host copy; computing the prompt", entry.req_id)
            self._forget(entry)
            return 0, False
        entry.load_from = computed
        return entry.end_tokens - computed, True

    def _try_stage(self, entry: _Entry, hits: int, request: Request, computed: int) -> tuple[int | None, bool]:
        new = len(entry.hashes) - hits
        got = self.pool.acquire(entry.hashes[:hits], new)
        if got is None:
            if new > self.pool.capacity or time.monotonic() >= entry.deadline:
                logger.warning(
                    "room=%d req=%s: no room for %d blocks in D's host pool (%d blocks, %d free or evictable); "
                    "the prompt is computed here",
                    entry.params.room, entry.req_id, new, self.pool.capacity, self.pool.available(),
                )  # fmt: skip
                del self._entries[entry.req_id]
                self._releases.append((entry.req_id, entry.params))
                return 0, False
            return None, False
        entry.pinned, entry.staged, entry.hits = got[0] + got[1], got[1], hits
        entry.state = D2RHState.STAGING
        p = entry.params
        self._stages.append(
            RecvJob(
                req_id=entry.req_id,
                room=p.room,
                bootstrap_host=p.bootstrap_host,
                bootstrap_port=p.bootstrap_port,
                prefill_dp_rank=p.prefill_dp_rank,
                dst_block_ids=list(got[1]),
                start_block=entry.start + hits,
                num_tokens=entry.end_tokens,
                arrival_time=getattr(request, "arrival_time", None),
                admitted_at=time.time(),
                trace_headers=getattr(request, "trace_headers", None),
            )
        )
        logger.info(
            "room=%d req=%s: staging %d blocks from block %d into D's host pool (%d host hits)",
            p.room, entry.req_id, new, entry.start + hits, hits,
        )  # fmt: skip
        return None, False

    def allocated(self, rid: str, device_blocks: list[int], num_external_tokens: int) -> None:
        """vLLM gave the request device blocks (all of group 0, its local prefix first)."""
        entry = self._entries.get(rid)
        if entry is None or entry.state not in (D2RHState.HOST_READY, D2RHState.STAGE_FAILED):
            return
        if num_external_tokens <= 0:
            self._forget(entry)
            return
        bs = self.block_size
        first = entry.load_from // bs
        last = -(-(entry.load_from + num_external_tokens) // bs)
        host = entry.pinned[first - entry.start : last - entry.start] if entry.pinned else []
        failed = entry.state is D2RHState.STAGE_FAILED
        self._loads.append(HostLoad(rid, list(host), list(device_blocks[first:last]), failed, entry.hits))
        entry.state = D2RHState.LOADING

    # ------------------------------------------------------------------ workers report

    def worker_output(self, meta: Any) -> None:
        if not isinstance(meta, D2RHWorkerMeta):
            return
        for rid, (ranks, failed) in meta.staged.items():
            entry = self._entries.get(rid)
            if entry is None or entry.state not in (D2RHState.STAGING, D2RHState.ORPHANED):
                continue
            entry.ranks += ranks
            entry.failed += failed
            if entry.ranks < self.ranks:
                continue
            entry.ranks = 0
            if not entry.failed:
                self.pool.commit(entry.staged, entry.hashes[entry.hits :])
            if entry.state is D2RHState.ORPHANED:
                self._forget(entry)
            elif entry.failed:
                self.pool.drop(entry.pinned)
                entry.pinned, entry.state = [], D2RHState.STAGE_FAILED
            else:
                entry.state = D2RHState.HOST_READY
        for rid, ranks in meta.loaded.items():
            entry = self._entries.get(rid)
            if entry is None or entry.state is not D2RHState.LOADING:
                continue
            entry.ranks += ranks
            if entry.ranks >= self.ranks:
                self._forget(entry)

    def finished(self, rid: str) -> None:
        """The request ended (vLLM frees its device blocks)."""
        entry = self._entries.get(rid)
        if entry is None:
            return
        if entry.state is D2RHState.STAGING:
            entry.state = D2RHState.ORPHANED
        elif entry.state is not D2RHState.LOADING:  # LOADING: unpinned once the workers' copies are done
            self._forget(entry)

    def take_step(self) -> tuple[list[RecvJob], list[HostLoad], list[tuple[str, DecodeParams]]]:
        """This step's staging jobs, host loads and released rooms (the scheduler's metadata)."""
        out = (self._stages, self._loads, self._releases)
        self._stages, self._loads, self._releases = [], [], []
        return out

    # ------------------------------------------------------------------ internals

    def _forget(self, entry: _Entry) -> None:
        self._entries.pop(entry.req_id, None)
        if entry.pinned:
            self.pool.release(entry.pinned)
            entry.pinned = []

    def _hash(self, request: Request, block: int, covered: int) -> Hashable | None:
        """vLLM's hash of ``block`` when it is full within ``covered`` tokens, else None."""
        hashes = getattr(request, "block_hashes", None) or ()
        if (block + 1) * self.block_size > covered or block >= len(hashes):
            return None
        return hashes[block]
