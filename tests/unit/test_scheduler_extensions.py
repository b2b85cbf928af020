"""PDScheduler's extensions (pd_connector.scheduling): which ones an engine runs, and how the
scheduler's hooks hand requests to them (answer, value and notice hooks)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from pd_connector.config import ConfigError, parse_config
from pd_connector.kv_params import PREFILL_WITHOUT_LAST_TOKEN, DecodeParams
from pd_connector.scheduler import PDScheduler
from pd_connector.scheduling.decode_first import DecodeFirstExtension
from pd_connector.scheduling.dp_rooms import DpRoomsExtension
from pd_connector.scheduling.extension import Finish, Match, Params, Plan, SchedulerExtension, overrides
from pd_connector.scheduling.layer_chunks import LayerChunk
from pd_connector.scheduling.layer_mode import LayerChunksExtension
from pd_connector.scheduling.migration import MigrationExtension
from pd_connector.scheduling.selection import extensions_for
from pd_connector.scheduling.state_groups import DecodeStateExtension, PrefillStateExtension
from tests.support.fake_scheduler import BS, D_PARAMS, P_PARAMS, FakeBlocks, FakeRequest, meta


def kinds(role: str, extra: dict[str, Any], **kwargs: Any) -> list[type]:
    return [type(e) for e in extensions_for(parse_config(role, extra), BS, **kwargs)]


def test_extensions_are_chosen_by_role_and_config() -> None:
    assert kinds("kv_consumer", {}) == [DecodeFirstExtension]
    assert kinds("kv_consumer", {"migration": True, "bootstrap_port": 18900}, state_groups={1: 4096}) == [
        DecodeFirstExtension,
        DecodeStateExtension,
        MigrationExtension,
    ]
    assert kinds("kv_producer", {}) == []
    assert kinds("kv_producer", {"transfer_mode": "layer"}, state_groups={1: 4096}) == [
        PrefillStateExtension,
        LayerChunksExtension,
    ]
    assert kinds("kv_producer", {"dp_size": 2}) == [DpRoomsExtension]
    engine = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=4))
    assert kinds("kv_producer", {}, vllm_config=engine) == [DpRoomsExtension]  # vLLM's DP size when dp_size unset


def test_d2rh_without_the_engine_config_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match="kv_connector_extra_config.d2rh"):
        extensions_for(parse_config("kv_consumer", {"d2rh": True}), BS)


def test_overrides_tells_an_extensions_own_hooks() -> None:
    ext = DpRoomsExtension(None)  # type: ignore[arg-type]
    assert overrides(ext, "arrived") and not overrides(ext, "match")


class Owner(SchedulerExtension):
    """Owns every D request: vLLM hears ``answer``; records the hooks it is told of."""

    def __init__(self, answer: Match) -> None:
        self.answer = answer
        self.seen: list[tuple[str, Any]] = []

    def match(self, request: Any, num_computed_tokens: int) -> Match | None:
        return self.answer if self.seen else None  # not on vLLM's first ask: the core plans then

    def take_load(self, request: Any, params: DecodeParams, num_computed_tokens: int, covered: int) -> Match | None:
        self.seen.append(("take_load", covered))
        return self.answer

    def decided(self, request_id: str, plan: Plan) -> None:
        self.seen.append(("decided", plan))

    def alloc(self, request: Any, params: Params, blocks: Any, num_external_tokens: int) -> bool:
        self.seen.append(("alloc", num_external_tokens))
        return True

    def finished(
        self, request: Any, params: Params, groups: list[list[int]], kv_pending: bool, answer: Finish
    ) -> Finish | None:
        self.seen.append(("finished", answer))
        return True, {"kept": True}


def test_an_extension_that_takes_a_load_answers_for_vllm_and_the_core_plans_nothing() -> None:
    owner = Owner(Match(None, False, Plan.UNDECIDED))
    sched = PDScheduler(parse_config("kv_consumer", {}), BS, extensions=[owner])
    req = FakeRequest("d-1", dict(D_PARAMS), 40)
    assert sched.get_num_new_matched_tokens(req, 16) == (None, False)  # type: ignore[arg-type]
    assert owner.seen == [("take_load", 40)]
    owner.answer = Match(24, True, Plan.PUSH)
    assert sched.get_num_new_matched_tokens(req, 16) == (24, True)  # type: ignore[arg-type]
    assert owner.seen[-1] == ("decided", Plan.PUSH)
    sched.update_state_after_alloc(req, FakeBlocks([3, 4]), 24)  # type: ignore[arg-type]
    assert owner.seen[-1] == ("alloc", 24)
    assert meta(sched).recvs == []  # the extension loads it
    req.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req, [3, 4]) == (True, {"kept": True})  # type: ignore[arg-type]
    assert owner.seen[-1] == ("finished", (False, None))  # the core's answer, which it replaced


def test_arrivals_are_parsed_only_when_an_extension_wants_them() -> None:
    plain = PDScheduler(parse_config("kv_producer", {}), BS)
    plain.on_new_request(FakeRequest("p-1", dict(P_PARAMS), 40))  # type: ignore[arg-type]
    assert not plain._parsed
    truncating = PDScheduler(parse_config("kv_producer", {}), BS, extensions=[PrefillStateExtension()])
    req = SimpleNamespace(
        request_id="p-2",
        kv_transfer_params=dict(P_PARAMS),
        num_prompt_tokens=40,
        prompt_token_ids=list(range(40)),
        _all_token_ids=list(range(40)),
        max_tokens=16,
        status=RequestStatus.WAITING,
    )
    truncating.on_new_request(req)  # type: ignore[arg-type]
    assert req.num_prompt_tokens == 39 and req.max_tokens == 1
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    held, answer = truncating.request_finished(req, [1, 2, 3])  # type: ignore[arg-type]
    assert held and answer is not None and answer[PREFILL_WITHOUT_LAST_TOKEN] is True
    assert answer["bootstrap_room"] == P_PARAMS["bootstrap_room"]


def _scheduled(rid: str, blocks: list[int], tokens: int) -> SimpleNamespace:
    new = SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=0)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={rid: tokens},
        total_num_scheduled_tokens=tokens,
    )


def test_layer_mode_streams_a_prefill_unless_its_room_is_held_for_another_request() -> None:
    sched = PDScheduler(parse_config("kv_producer", {"transfer_mode": "layer"}), BS)
    first = FakeRequest("p-1", dict(P_PARAMS), 40)
    sched.update_state_after_alloc(first, FakeBlocks([4, 5, 6]), 0)  # type: ignore[arg-type]
    step = sched.build_connector_meta(_scheduled("p-1", [4, 5, 6], 40))  # type: ignore[arg-type]
    assert step.layer_chunks == [LayerChunk("p-1", 88, (4, 5, 6), 0, 3, True)]
    first.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert sched.request_finished(first, [4, 5, 6])[0]  # type: ignore[arg-type]
    assert sched.room_holder(88) == "p-1"
    second = FakeRequest("p-2", dict(P_PARAMS), 40)  # same room while p-1's KV is held
    sched.update_state_after_alloc(second, FakeBlocks([7, 8, 9]), 0)  # type: ignore[arg-type]
    step = sched.build_connector_meta(_scheduled("p-2", [7, 8, 9], 40))  # type: ignore[arg-type]
    assert step.layer_chunks == []
