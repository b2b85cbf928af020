"""The bootstrap server's state: one prefill deployment's topology, rank table and room -> DP rank map.

``BootstrapState`` is what ``bootstrap.server``'s routes read and change (under its lock); it holds no
transfer state.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import msgspec

from pd_connector.messages import RankInfo, RegisterRank, Route, rank_key

MAX_ROOMS = 1_000_000  # room -> dp-rank entries kept before the oldest are dropped


class Conflict(ValueError):
    """A registration would replace a live entry without the token (HTTP 409)."""


class RegisterDpRank(msgspec.Struct, frozen=True):
    bootstrap_room: int
    dp_rank: int


class QueryDpRanks(msgspec.Struct, frozen=True):
    bootstrap_rooms: list[int]


@dataclass
class BootstrapState:
    """Topology of one prefill deployment and who serves which room."""

    attn_tp_size: int
    attn_dp_size: int
    attn_cp_size: int = 1
    block_size: int = 0
    kv_cache_dtype: str = ""
    num_layers: int = 0
    model: str = ""
    pp_size: int = 1  # pipeline stages (layouts.pp); each registers its layers
    rank_table: dict[tuple[int, int, int, int], RankInfo] = field(default_factory=dict)  # (dp, cp, tp, pp)
    #: pp rank -> (first_layer, end_layer, KV layers) its ranks registered
    stages: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    room_to_dp_rank: dict[int, int] = field(default_factory=dict)
    refused: int = 0  # calls refused for a missing or wrong token
    conflicts: int = 0  # registrations refused because they would replace a live entry (409)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def expected_count(self) -> int:
        return self.attn_tp_size * self.attn_cp_size * self.attn_dp_size * self.pp_size

    @property
    def is_ready(self) -> bool:
        return len(self.rank_table) >= self.expected_count

    def register_rank(self, req: RegisterRank) -> None:
        if (req.attn_tp_size, req.attn_dp_size, req.attn_cp_size, req.pp_size) != (
            self.attn_tp_size,
            self.attn_dp_size,
            self.attn_cp_size,
            self.pp_size,
        ):
            raise ValueError(
                f"rank reports tp/dp/cp/pp sizes {req.attn_tp_size}/{req.attn_dp_size}/{req.attn_cp_size}/"
                f"{req.pp_size}, this deployment has {self.attn_tp_size}/{self.attn_dp_size}/{self.attn_cp_size}/"
                f"{self.pp_size}"
            )
        key = (req.attn_dp_rank, req.attn_cp_rank, req.attn_tp_rank, req.pp_rank)
        if not (
            0 <= key[0] < self.attn_dp_size
            and 0 <= key[1] < self.attn_cp_size
            and 0 <= key[2] < self.attn_tp_size
            and 0 <= key[3] < self.pp_size
        ):
            raise ValueError(f"rank (dp, cp, tp, pp) = {key} is outside the deployment's topology")
        if self.pp_size > 1 and not req.first_layer < req.end_layer:
            raise ValueError(
                f"pipeline stage {req.pp_rank} registered layers [{req.first_layer}, {req.end_layer}): "
                "a stage of a pipeline-parallel prefill must name its layers"
            )
        with self.lock:
            stage = self.stages.get(req.pp_rank)
            layers = (req.first_layer, req.end_layer, req.num_layers)
            if self.pp_size > 1 and stage is not None and stage != layers:
                raise ValueError(
                    f"rank (dp, cp, tp, pp) = {key} holds layers [{req.first_layer}, {req.end_layer}) "
                    f"({req.num_layers} KV layers), other ranks of stage {req.pp_rank} registered "
                    f"[{stage[0]}, {stage[1]}) ({stage[2]})"
                )
            if self.block_size and (req.block_size, req.kv_cache_dtype) != (
                self.block_size,
                self.kv_cache_dtype,
            ):
                raise ValueError(
                    f"rank has block_size/kv_cache_dtype {req.block_size}/{req.kv_cache_dtype}, "
                    f"others registered {self.block_size}/{self.kv_cache_dtype}"
                )
            self.block_size, self.kv_cache_dtype = req.block_size, req.kv_cache_dtype
            if self.model and req.model and req.model != self.model:
                raise ValueError(f"rank serves model {req.model!r}, others registered {self.model!r}")
            self.model = req.model or self.model
            self.rank_table[key] = RankInfo(
                rank_ip=req.rank_ip,
                rank_port=req.rank_port,
                batch_stall_s=req.batch_stall_s,  # D's wait for a stopped load (transfer.loads.timing_of)
                peer_timeout_s=req.peer_timeout_s,
            )
            self.stages[req.pp_rank] = layers
            # the model's KV layers: every stage's (with PP 1 the one stage's)
            self.num_layers = sum(n for _, _, n in self.stages.values()) or self.num_layers

    def route(self) -> Route:
        with self.lock:
            ranks = {rank_key(*k): v for k, v in self.rank_table.items()}
            stage_layers = [self.stages.get(s, (0, 0, 0))[:2] for s in range(self.pp_size)] if self.pp_size > 1 else []
            return Route(
                attn_tp_size=self.attn_tp_size,
                attn_cp_size=self.attn_cp_size,
                dp_size=self.attn_dp_size,
                block_size=self.block_size,
                kv_cache_dtype=self.kv_cache_dtype,
                num_layers=self.num_layers,
                is_ready=self.is_ready,
                ranks=ranks,
                model=self.model,
                pp_size=self.pp_size,
                stage_layers=stage_layers,
            )

    def register_dp_rank(self, room: int, dp_rank: int, replace: bool = False) -> int | None:
        """Map ``room`` to ``dp_rank``; the previous rank if this moved the room (only with ``replace``)."""
        if not 0 <= dp_rank < self.attn_dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{self.attn_dp_size - 1}")
        with self.lock:
            old = self.room_to_dp_rank.get(room)
            if old is not None and old != dp_rank and not replace:
                self.conflicts += 1
                raise Conflict(
                    f"room {room} is served by dp rank {old}; moving it to {dp_rank} needs the deployment's auth token"
                )
            self.room_to_dp_rank[room] = dp_rank
            while len(self.room_to_dp_rank) > MAX_ROOMS:
                self.room_to_dp_rank.pop(next(iter(self.room_to_dp_rank)))
        return old if old is not None and old != dp_rank else None

    def query_dp_ranks(self, rooms: list[int]) -> dict[str, int]:
        with self.lock:
            return {str(r): self.room_to_dp_rank[r] for r in rooms if r in self.room_to_dp_rank}
