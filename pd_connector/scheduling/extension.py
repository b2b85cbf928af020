"""The optional features of PDConnector's scheduler side, as extensions of ``PDScheduler`` (no I/O).

``PDScheduler`` (pd_connector.scheduler) does what every disaggregated request needs: D asks vLLM to hold
the prompt tokens P prefilled for an async load, P keeps a finished prefill's blocks until its push is
done. Everything else is a ``SchedulerExtension``, chosen once per engine by role and config
(``scheduling.selection.extensions_for``): each of the scheduler's hooks runs its core logic and then
iterates the extensions in order. An extension overrides only the hooks it needs; the base class's
hooks do nothing and answer nothing.

Three kinds of hook:

- answer hooks (``params``, ``match``, ``take_load``): an extension that owns the request returns an
  answer, any other returns None; the first answer wins. ``params`` and ``match`` are asked before the
  core looks at the request: that is how an extension that took a request over keeps it.
- value hooks (``prefilled``, ``load_blocks``, ``finished``): they get the core's value and return it,
  changed or not (``finished``: None keeps it); each extension sees the previous one's value.
- notices (``attach``, ``arrived``, ``decided``, ``alloc``, ``output``, ``meta``, ``busy``): every
  extension is told (``alloc`` comes before the core's part; an extension answering True there loads
  the request itself, ``busy``: any True keeps vLLM's engine loop stepping).

Like the scheduler, an extension does no I/O on vLLM's scheduler thread (a post to a server is queued
for a thread of its own: bootstrap.dp_rooms, ascend.metaserver).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pd_connector.kv_params import DecodeParams, PrefillParams
from pd_connector.metadata import PDConnectorMetadata, RecvJob

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

#: A request's parsed kv_transfer_params (None: it carries none, or they were malformed).
Params = PrefillParams | DecodeParams | None
#: ``request_finished``'s answer to vLLM: (keep the blocks until finished_sending, kv_transfer_params out).
Finish = tuple[bool, dict[str, Any] | None]


class Plan(enum.Enum):
    """What D decided P does with a D request's room."""

    UNDECIDED = "undecided"  # not yet: vLLM asks about the request again (get_num_new_matched_tokens)
    PUSH = "push"  # P pushes the room's KV into blocks D holds for it now (device blocks, or host pool blocks)
    FREE = "free"  # nothing is loaded from P: P is told to free the room


@dataclass(frozen=True)
class Match:
    """An extension's answer to ``get_num_new_matched_tokens`` for a request it owns."""

    tokens: int | None  # vLLM's count of tokens to load; None: ask again next step
    load_async: bool
    plan: Plan


class SchedulerCore(Protocol):
    """What an extension may ask the scheduler it serves (read-only)."""

    def room_holder(self, room: int) -> str | None:
        """P: the request whose finished prefill holds ``room``'s KV, or None when the room is free."""
        ...


def room_release(rid: str, params: DecodeParams) -> RecvJob:
    """D: a job whose worker only tells P to free the room (TransferCancel), no load."""
    return RecvJob(rid, params.room, params.bootstrap_host, params.bootstrap_port, params.prefill_dp_rank, [], 0, 0)


class SchedulerExtension:
    """One optional feature of the scheduler side. Every hook here does nothing and answers nothing.

    Each hook's docstring names the vLLM call behind it (KVConnectorBase_V1's scheduler side, vLLM 0.32
    and 0.23 alike) and what the device has done by then. All run on vLLM's scheduler thread in the
    EngineCore process, never on a device.
    """

    def attach(self, core: SchedulerCore) -> None:
        """``PDScheduler``'s constructor, once: the scheduler this extension serves."""

    def params(self, request: Request) -> DecodeParams | PrefillParams | None:
        """Answer: the request's parameters, when this extension reads them from something other than
        ``kv_transfer_params`` as the Router writes them. Asked once per request, on its first hook."""
        return None

    def arrived(self, request: Request, params: Params) -> None:
        """Notice: vLLM's scheduler added the request (``on_new_request``, from ``Scheduler.add_request``),
        before it is ever scheduled; the extension may still change the request (its prompt)."""

    def match(self, request: Request, num_computed_tokens: int) -> Match | None:
        """Answer to vLLM's ``get_num_new_matched_tokens`` (asked for a waiting request, maybe every step),
        for a request whose load this extension owns; asked before the core looks at the request.
        No block is allocated for the request yet."""
        return None

    def prefilled(self, request: Request, params: DecodeParams, tokens: int | None) -> int | None:
        """Value: D's count of the prompt tokens whose KV P holds (``get_num_new_matched_tokens``,
        ``update_state_after_alloc``); None: the prompt is prefilled on D and P frees the room."""
        return tokens

    def take_load(self, request: Request, params: DecodeParams, num_computed_tokens: int, covered: int) -> Match | None:
        """Answer: D would load ``covered - num_computed_tokens`` prompt tokens from P into device blocks;
        an extension that loads them otherwise answers for vLLM and owns the request from then on."""
        return None

    def decided(self, request_id: str, plan: Plan) -> None:
        """Notice: D decided what P does with the request's room (``Plan.PUSH`` or ``Plan.FREE``); once
        per request, in ``get_num_new_matched_tokens`` or ``update_state_after_alloc``."""

    def alloc(self, request: Request, params: Params, blocks: KVCacheBlocks, num_external_tokens: int) -> bool:
        """Notice of vLLM's ``update_state_after_alloc``: blocks are allocated for the request (after a
        load, maybe a second time); nothing is written into them yet. True: this extension loads the
        request (the core plans no load for it)."""
        return False

    def load_blocks(
        self,
        request: Request,
        params: DecodeParams,
        tables: Sequence[Sequence[int]],
        groups: list[list[int]],
        covered: int,
        start_block: int,
    ) -> list[list[int]]:
        """Value: per KV cache group, the blocks P fills for a D load of ``covered`` tokens from block
        ``start_block`` on (``update_state_after_alloc``); ``tables``: vLLM's block tables of the request."""
        return groups

    def finished(
        self, request: Request, params: Params, groups: list[list[int]], kv_pending: bool, answer: Finish
    ) -> Finish | None:
        """Value: the answer to vLLM's ``request_finished`` (``request_finished_all_groups`` with HMA),
        called once per finished request on both roles, aborted ones on D included, before vLLM frees its
        blocks (``groups``: one list per KV cache group). The extension forgets the request; it returns
        another answer, or None to keep ``answer``. ``kv_pending``: D has not seen the request's KV in its
        blocks yet (never asked for, loading, or landed and not run since)."""
        return None

    def output(self, output: KVConnectorOutput) -> None:
        """Notice of vLLM's ``update_connector_output``: the workers' aggregated results of a step
        (finished_sending, finished_recving, kv_connector_worker_meta)."""

    def meta(self, scheduler_output: SchedulerOutput, meta: PDConnectorMetadata) -> None:
        """Notice of vLLM's ``build_connector_meta``, at the end of every ``schedule()``, before the step's
        forward is queued: the extension adds its work for the workers to ``meta``."""

    def busy(self) -> bool:
        """vLLM's ``has_pending_push_work``, polled by the engine loop: True keeps it stepping."""
        return False


def overrides(extension: SchedulerExtension, hook: str) -> bool:
    """Whether ``extension`` has a hook of its own named ``hook`` (not the base class's)."""
    return getattr(type(extension), hook) is not getattr(SchedulerExtension, hook)
