"""D, requests of vLLM-Ascend's layer-wise proxy (D first): the scheduler's part (pd_connector.ascend.metaserver).

Such a request names the proxy's metaserver instead of a prefill: D picks its room, and once D's blocks
for it exist (its load is planned), D posts the room to the metaserver, which then asks a prefill. The
post runs on the sender's own thread; here it is only queued.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pd_connector.ascend.metaserver import DecodeFirst
from pd_connector.kv_params import DecodeParams
from pd_connector.scheduling.extension import Finish, Params, Plan, SchedulerExtension

if TYPE_CHECKING:
    from vllm.v1.request import Request


class DecodeFirstExtension(SchedulerExtension):
    """Chosen on every D: whether a request is D first is the request's own choice (its ``metaserver``)."""

    def __init__(self, first: DecodeFirst) -> None:
        self.first = first

    def params(self, request: Request) -> DecodeParams | None:
        """A D-first request's DecodeParams (its room picked here); None for any other request."""
        return self.first.params_of(request)

    def decided(self, request_id: str, plan: Plan) -> None:
        """P's push is planned into blocks D holds now: the post is queued; else it is never made."""
        if plan is Plan.PUSH:
            self.first.allocated(request_id)
        else:
            self.first.forget(request_id)

    def finished(
        self, request: Request, params: Params, groups: list[list[int]], kv_pending: bool, answer: Finish
    ) -> Finish | None:
        self.first.forget(request.request_id)
        return None
