"""P with several DP ranks: each request's room registered with this rank on arrival (pd_connector.bootstrap.dp_rooms).

The registrar only queues the room here; its own thread posts it to the bootstrap server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pd_connector.bootstrap.dp_rooms import DpRoomRegistrar
from pd_connector.kv_params import PrefillParams
from pd_connector.scheduling.extension import Params, SchedulerExtension

if TYPE_CHECKING:
    from vllm.v1.request import Request


class DpRoomsExtension(SchedulerExtension):
    """Chosen on P when its deployment has several DP ranks (``dp_rooms_for``)."""

    def __init__(self, registrar: DpRoomRegistrar) -> None:
        self.registrar = registrar

    def arrived(self, request: Request, params: Params) -> None:
        if isinstance(params, PrefillParams) and params.room is not None:
            self.registrar.seen(params.room, request.request_id)
