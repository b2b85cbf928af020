"""Tiny fakes for driving PDScheduler without vLLM's engine: requests, KV blocks, parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.request import RequestStatus

from pd_connector.metadata import PDConnectorMetadata
from pd_connector.scheduler import PDScheduler

BS = 16
D_PARAMS = {
    "do_remote_prefill": True,
    "bootstrap_room": 77,
    "bootstrap_host": "10.1.2.3",
    "bootstrap_port": 18800,
    "prefill_dp_rank": 1,
}
P_PARAMS = {"do_remote_decode": True, "bootstrap_room": 88}


@dataclass
class FakeRequest:
    request_id: str
    kv_transfer_params: Any
    num_prompt_tokens: int
    status: RequestStatus = RequestStatus.WAITING


class FakeBlocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.ids),)


def meta(s: PDScheduler) -> PDConnectorMetadata:
    m = s.build_connector_meta(None)  # type: ignore[arg-type]
    assert isinstance(m, PDConnectorMetadata)
    return m
