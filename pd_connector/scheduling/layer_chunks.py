"""P, layer-wise push (``transfer_mode: "layer"``), scheduler side: which blocks each step completes.

Pure bookkeeping (no vLLM import, no I/O). ``scheduling.layer_mode.LayerChunksExtension`` (chosen on P
with transfer_mode "layer") registers every P request with a free room once vLLM allocated its blocks
(`track`), and for every engine step `ChunkPlanner.plan(scheduler_output)` says, per such
request scheduled in that step, which of its blocks hold every token once the step's forward is
done: a `LayerChunk`. The worker (`transfer.layerwise`) writes those blocks of each layer to D as
soon as that layer's attention ran. A chunk that does not end the prompt completes only the
blocks its tokens fill; the final chunk also completes the last, partial block. A request's
first chunk (and the first after a preemption) starts at block 0: blocks from P's prefix cache
already hold their KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LayerChunk:
    """Scheduler -> worker: after this step, blocks ``[0, end)`` of the room hold every token's KV."""

    req_id: str
    room: int
    block_ids: tuple[int, ...]  # P's blocks of the request, [0, end) at least
    start: int  # first block this step completes (0 on the request's first step)
    end: int
    final: bool  # this step computes the prompt's last token: the room's KV is complete after it


@dataclass
class _Plan:
    room: int
    prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    done: int = 0  # blocks complete before this step


class ChunkPlanner:
    """Per P request with a room: its blocks so far and how many of them are complete."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._plans: dict[str, _Plan] = {}

    def track(self, req_id: str, room: int, prompt_tokens: int) -> bool:
        """A P request with a room was admitted (update_state_after_alloc); idempotent.

        False (not tracked) when another tracked request has the room: two prompts never stream
        into one room (P refuses the second prefill when it finishes).
        """
        if req_id not in self._plans and any(p.room == room for p in self._plans.values()):
            return False
        self._plans.setdefault(req_id, _Plan(room, prompt_tokens))
        return True

    def forget(self, req_id: str) -> None:
        self._plans.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._plans)

    def plan(self, scheduler_output: Any) -> list[LayerChunk]:
        """The chunks of this step (vLLM's SchedulerOutput: new and cached requests, scheduled tokens)."""
        if not self._plans:
            return []
        scheduled: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        computed: dict[str, int] = {}
        for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            plan = self._plans.get(new.req_id)
            if plan is not None:
                plan.block_ids, plan.done = list(new.block_ids[0]) if new.block_ids else [], 0
                computed[new.req_id] = new.num_computed_tokens
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = getattr(cached, "resumed_req_ids", None) or set()
            for i, req_id in enumerate(cached.req_ids):
                plan = self._plans.get(req_id)
                if plan is None:
                    continue
                new_ids = cached.new_block_ids[i]
                if req_id in resumed:  # preempted and rescheduled: new blocks, recomputed from its prefix hit
                    plan.block_ids, plan.done = list(new_ids[0]) if new_ids else [], 0
                elif new_ids:
                    plan.block_ids.extend(new_ids[0])
                computed[req_id] = cached.num_computed_tokens[i]
        chunks = []
        for req_id, before in computed.items():
            plan = self._plans[req_id]
            tokens = scheduled.get(req_id, 0)
            if tokens <= 0 or plan.done < 0:
                continue
            after = min(before + tokens, plan.prompt_tokens)
            final = after >= plan.prompt_tokens
            end = -(-after // self.block_size) if final else after // self.block_size
            end = min(end, len(plan.block_ids))
            if end > plan.done or final:
                chunks.append(LayerChunk(req_id, plan.room, tuple(plan.block_ids[:end]), plan.done, end, final))
            plan.done = -1 if final else end  # -1: the prompt is done; decode steps add nothing
        return chunks
