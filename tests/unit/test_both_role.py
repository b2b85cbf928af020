"""kv_role kv_both: the config it takes and refuses, and its scheduler side choosing P or D per request."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from pd_connector.config import BOTH, ConfigError, Mode, parse_config
from pd_connector.metadata import RecvJob, SendJob
from pd_connector.refusals import UnsupportedSetupError, refuse_unsupported
from pd_connector.scheduler import PDScheduler
from pd_connector.scheduling.decode_first import DecodeFirstExtension
from pd_connector.scheduling.selection import extensions_for
from tests.support.fake_scheduler import BS, D_PARAMS, P_PARAMS, FakeBlocks, FakeRequest, meta


def test_kv_both_is_both_sides() -> None:
    cfg = parse_config("kv_both", {"bootstrap_port": 18900})
    assert cfg.mode is BOTH and isinstance(cfg.mode, Mode) and str(cfg.mode) == "both"
    assert cfg.is_both and cfg.is_prefill and cfg.is_decode and cfg.pushes_kv
    for role in ("kv_producer", "kv_consumer"):
        assert not parse_config(role, {}).is_both


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"d2rh": True}, "d2rh"),
        ({"d2rh_zmq_port": 38100}, "d2rh"),  # vLLM-Ascend's D2RH keys turn d2rh on
        ({"transfer_mode": "layer"}, "transfer_mode"),
        ({"migration": True, "bootstrap_port": 18900}, "migration"),
        ({"dp_size": 2, "dp_rank": 0}, "dp_size"),
    ],
)
def test_kv_both_refuses_what_it_does_not_support_naming_the_setting(extra: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=f"kv_connector_extra_config.{key}: .* not supported with kv_role kv_both"):
        parse_config("kv_both", extra)
    parse_config("kv_producer" if key != "migration" else "kv_consumer", extra)  # fine on a one-sided instance


@pytest.mark.parametrize(
    ("parallel", "named"),
    [
        ({"data_parallel_size": 2}, "--data-parallel-size 2 (parallel_config.data_parallel_size)"),
        ({"pipeline_parallel_size": 2}, "-pp 2 (parallel_config.pipeline_parallel_size)"),
    ],
)
def test_kv_both_refuses_vllm_dp_and_pp_at_start_up(parallel: dict[str, int], named: str) -> None:
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(**parallel), model_config=None)
    with pytest.raises(UnsupportedSetupError, match="kv_role kv_both") as err:
        refuse_unsupported(parse_config("kv_both", {}), vllm_config, None)
    assert named in str(err.value)
    refuse_unsupported(parse_config("kv_consumer", {}), vllm_config, None)  # other roles: not this refusal


@pytest.fixture
def bsched() -> PDScheduler:
    return PDScheduler(parse_config("kv_both", {"bootstrap_port": 18900}), block_size=BS)


def test_kv_both_runs_decode_and_prefill_extensions() -> None:
    chosen = extensions_for(parse_config("kv_both", {}), BS)
    assert [type(e) for e in chosen] == [DecodeFirstExtension]  # as on D; P's need layer mode, DP or state


def test_prefill_params_make_the_request_ps(bsched: PDScheduler) -> None:
    req = FakeRequest("p-1", dict(P_PARAMS), 50)
    assert bsched.get_num_new_matched_tokens(req, 0) == (0, False)  # P computes its prompt
    bsched.update_state_after_alloc(req, FakeBlocks([3, 4, 8, 9]), 0)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, answer = bsched.request_finished(req, [3, 4, 8, 9])
    assert delay is True and answer is not None
    assert answer["do_remote_prefill"] is True and answer["bootstrap_room"] == 88
    assert answer["bootstrap_port"] == 18900  # this instance's own bootstrap server
    assert "pd_kv" not in answer  # D's account is for requests it decodes
    m = meta(bsched)
    assert m.sends == [SendJob(req_id="p-1", room=88, block_ids=[3, 4, 8, 9], num_tokens=50)]
    assert m.recvs == []
    assert bsched.has_pending_push_work()
    bsched.update_connector_output(KVConnectorOutput(finished_sending={"p-1"}))
    assert not bsched.has_pending_push_work()
    assert bsched.bypassed.take() is None


def test_decode_params_make_the_request_ds(bsched: PDScheduler) -> None:
    req = FakeRequest("d-1", dict(D_PARAMS), 100)
    assert bsched.get_num_new_matched_tokens(req, 32) == (68, True)
    bsched.update_state_after_alloc(req, FakeBlocks([40, 41, 10, 11, 12, 30, 31]), 68)
    m = meta(bsched)
    assert m.sends == []
    assert m.recvs == [
        RecvJob(
            req_id="d-1",
            room=77,
            bootstrap_host="10.1.2.3",
            bootstrap_port=18800,
            prefill_dp_rank=1,
            dst_block_ids=[10, 11, 12, 30, 31],
            start_block=2,
            num_tokens=100,
        )
    ]
    bsched.update_connector_output(KVConnectorOutput(finished_recving={"d-1"}))
    req.status = RequestStatus.FINISHED_STOPPED
    delay, answer = bsched.request_finished(req, [40, 41, 10, 11, 12, 30, 31])
    assert delay is False  # D hands nothing over
    assert answer is not None and answer["pd_kv"]["pushed_tokens"] == 68
    assert not bsched.has_pending_push_work()
    assert bsched.bypassed.take() is None  # a D request on kv_both is no wrong-role bypass


def test_a_request_without_params_is_ordinary(bsched: PDScheduler) -> None:
    req = FakeRequest("o-1", None, 40)
    assert bsched.get_num_new_matched_tokens(req, 0) == (0, False)
    bsched.update_state_after_alloc(req, FakeBlocks([1, 2, 3]), 0)
    req.status = RequestStatus.FINISHED_STOPPED
    delay, _ = bsched.request_finished(req, [1, 2, 3])
    assert delay is False
    m = meta(bsched)
    assert m.sends == [] and m.recvs == []
    assert bsched.bypassed.take() == {"no_kv_transfer_params": 1}
