"""A recurrent-state KV cache group (Mamba2 / gated delta net) moved P -> D (pd_connector.layouts.state_groups).

Against vLLM's real classes: its Scheduler with a ``MambaSpec`` group beside a full-attention group
(prefix caching off: mamba_cache_mode 'none', one state block per request, the group's block size the
model length), and its KV cache spec classes for the transfer layout: per-layer conv and SSM state
tensors laid out as vLLM lays them in a shared page (the attention layer's page of the same block
pool), turned into regions and write entries by the same code P runs, and copied byte for byte.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.outputs import KVConnectorOutput

from pd_connector.bypass import BypassReason
from pd_connector.kv_params import PREFILL_WITHOUT_LAST_TOKEN, DecodeParams, parse_kv_params
from pd_connector.layouts.kv_groups import NULL_BLOCK, group_entries, group_pairs, region_groups
from pd_connector.layouts.regions import regions_of_kv_caches
from pd_connector.layouts.state_groups import (
    MIN_VLLM,
    fill_state_groups,
    prefilled_for_state,
    state_slice,
    vllm_version,
)
from pd_connector.layouts.tp import plan_decode_rank, slices_from, tp_transfer_entries
from tests.support import real_scheduler
from tests.support.real_scheduler import BLOCK, D_PARAMS, PROMPT, make_scheduler, request, step

pytestmark = pytest.mark.skipif(
    vllm_version() < MIN_VLLM, reason="PDConnector moves recurrent state on vLLM >= 0.32 only (refused on 0.23)"
)

MODEL_LEN = 1024  # tests.support.real_scheduler's max_model_len: a 'none'-mode state block's tokens
CONV, SSM = (3, 288), (8, 32, 16)  # the tiny GraniteMoeHybrid's Mamba2 state shapes (launch.tiny_hybrid)


def mamba2(block: int = MODEL_LEN, page: int | None = None) -> MambaSpec:
    return MambaSpec(
        block_size=block,
        shapes=(CONV, SSM),
        dtypes=(torch.float32, torch.float32),
        page_size_padded=page,
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
    )


def groups() -> list[KVCacheGroupSpec]:
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    return [KVCacheGroupSpec(["m.0", "m.2"], mamba2()), KVCacheGroupSpec(["a.1", "a.3"], full)]


@pytest.fixture
def model(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny model; vLLM's Scheduler built with the groups' common block multiple as its block size
    (vLLM passes the least common multiple of the groups' block sizes: here the state group's)."""

    def scheduler(**kwargs: Any) -> Scheduler:
        return Scheduler(**{**kwargs, "block_size": MODEL_LEN})

    monkeypatch.setattr(real_scheduler, "Scheduler", scheduler)
    return tiny_model


# ------------------------------------------------------------ vLLM's scheduler


def test_prefill_computes_all_but_the_last_prompt_token_and_says_so(model: Path) -> None:
    sched = make_scheduler(model, "kv_producer", groups=groups())
    sched.add_request(request("p-1", {"do_remote_decode": True}, max_tokens=4))
    req = sched.requests["p-1"]
    assert req.num_prompt_tokens == len(PROMPT) - 1 and req.max_tokens == 1
    out, _, engine_out = step(sched)
    assert out.num_scheduled_tokens["p-1"] == len(PROMPT) - 1
    (answer,) = [o.kv_transfer_params for eo in engine_out.values() for o in eo.outputs if o.request_id == "p-1"]
    assert answer[PREFILL_WITHOUT_LAST_TOKEN] is True  # the Router's first-token path stands aside
    assert isinstance(parse_kv_params(answer), DecodeParams)  # what D gets, the mark included
    _, meta, _ = step(sched)
    (send,) = meta.sends
    state, full = send.group_block_ids
    assert send.num_tokens == len(PROMPT) - 1
    assert len(state) == 1 and state[0] != NULL_BLOCK  # one state block per request
    assert len(full) == -(-(len(PROMPT) - 1) // BLOCK) and NULL_BLOCK not in full
    step(sched, KVConnectorOutput(finished_sending={"p-1"}))


def test_a_one_token_prompt_is_prefilled_whole_and_not_marked(model: Path) -> None:
    sched = make_scheduler(model, "kv_producer", groups=groups())
    sched.add_request(request("p-2", {"do_remote_decode": True}, max_tokens=1, prompt=[9]))
    assert sched.requests["p-2"].num_prompt_tokens == 1
    _, _, engine_out = step(sched)
    (answer,) = [o.kv_transfer_params for eo in engine_out.values() for o in eo.outputs if o.request_id == "p-2"]
    assert PREFILL_WITHOUT_LAST_TOKEN not in answer


def test_decode_loads_all_but_the_last_token_and_the_state_block(model: Path) -> None:
    sched = make_scheduler(model, "kv_consumer", groups=groups())
    sched.add_request(request("d-1", dict(D_PARAMS)))
    _, meta, _ = step(sched)
    (job,) = meta.recvs
    state, full = job.dst_group_block_ids
    tables = sched.kv_cache_manager.get_block_ids("d-1")
    assert job.num_tokens == len(PROMPT) - 1
    assert state == [tables[0][0]] and state[0] != NULL_BLOCK
    assert full == list(tables[1][: -(-(len(PROMPT) - 1) // BLOCK)])
    step(sched, KVConnectorOutput(finished_recving={"d-1"}))
    out, _, _ = step(sched)
    assert out.num_scheduled_tokens.get("d-1") == 1  # D computes the last prompt token from P's state


@pytest.mark.parametrize(
    ("prompt", "extra"), [([9], {}), (PROMPT, {"prefilled_tokens": len(PROMPT) - 1})], ids=["one-token", "first-token"]
)
def test_decode_prefills_what_prefill_holds_no_state_for(
    model: Path, prompt: list[int], extra: dict, pd_logs: pytest.LogCaptureFixture
) -> None:
    """A one-token prompt, or the first-token path's continuation: D prefills it and P is told to free the room."""
    sched = make_scheduler(model, "kv_consumer", groups=groups())
    sched.add_request(request("d-2", {**D_PARAMS, **extra}, prompt=prompt))
    out, meta, _ = step(sched)
    assert not meta.recvs and [j.room for j in meta.abandoned] == [D_PARAMS["bootstrap_room"]]
    assert out.num_scheduled_tokens["d-2"] == len(prompt)
    assert f"without a KV transfer ({BypassReason.STATE_RECOMPUTE.value})" in pd_logs.text


def test_state_slice_and_prefilled_tokens() -> None:
    assert prefilled_for_state(1, None) is None and prefilled_for_state(52, 51) is None
    assert prefilled_for_state(52, None) == 51
    assert state_slice([7], 51, MODEL_LEN, 0) == [7]  # 'none' mode: block 0 whatever the length
    assert state_slice([0, 0, 0, 9], 51, 16, 0) == [0, 0, 0, 9]  # 'align' mode: cdiv(51, 16) - 1 = 3
    assert state_slice([0, 5, 0, 9], 51, 16, 2) == [0, 9]
    assert state_slice([0, 0, 0, 0], 51, 16, 0) is None and state_slice([7], 51, 16, 0) is None
    groups = [[1, 2, 3, 4], [5, 6, 7, 8]]  # the slices decode_group_blocks made: group 0 is a state group
    assert fill_state_groups(groups, [[9], [5, 6, 7, 8]], {0: MODEL_LEN}, 51, 0) == [] and groups[0] == [9]
    assert fill_state_groups(groups, [[0], [5, 6, 7, 8]], {0: MODEL_LEN}, 51, 0) == [0] and groups[0] == []


# ------------------------------------------------------------ the transfer layout


def _as_vllm_lays_it(num_blocks: int, page: int, seed: int) -> dict[str, list[torch.Tensor] | torch.Tensor]:
    """Per layer pair, one raw buffer of ``num_blocks`` pages shared by a Mamba2 layer (conv state then SSM
    state in each page, vLLM's strided views) and an attention layer (its K and V of the page's block)."""
    torch.manual_seed(seed)
    out: dict[str, list[torch.Tensor] | torch.Tensor] = {}
    per_page = page // 4
    conv_elems = CONV[0] * CONV[1]
    for m, a in (("m.0", "a.1"), ("m.2", "a.3")):
        raw = torch.randn(num_blocks * per_page, dtype=torch.float32)
        conv = raw.as_strided((num_blocks, *CONV), (per_page, CONV[1], 1), 0)
        ssm = raw.as_strided((num_blocks, *SSM), (per_page, SSM[1] * SSM[2], SSM[2], 1), conv_elems)
        out[m] = [conv, ssm]
        out[a] = raw.as_strided((num_blocks, 2, BLOCK, 8), (per_page, BLOCK * 8, 8, 1), 0)
    return out


def test_state_group_moves_one_state_per_layer_byte_exact() -> None:
    num_blocks = 12
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    state = mamba2()
    page = max(full.page_size_bytes, state.page_size_bytes)
    state = mamba2(page=page)  # vLLM pads the smaller page to the larger one: one block pool for both
    specs = [KVCacheGroupSpec(["m.0", "m.2"], state), KVCacheGroupSpec(["a.1", "a.3"], full)]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs)
    p_kv, d_kv = _as_vllm_lays_it(num_blocks, page, 1), _as_vllm_lays_it(num_blocks, page, 2)
    d_before = {k: [t.clone() for t in v] if isinstance(v, list) else v.clone() for k, v in d_kv.items()}
    owners = region_groups(p_kv, config, num_blocks)
    assert owners == (0, 0, 1, 0, 0, 1)  # conv, ssm of m.0; a.1; conv, ssm of m.2; a.3
    src, dst = regions_of_kv_caches(p_kv, num_blocks), regions_of_kv_caches(d_kv, num_blocks)
    state_bytes = (CONV[0] * CONV[1] + SSM[0] * SSM[1] * SSM[2]) * 4
    assert [r.block_bytes for r, g in zip(src, owners, strict=True) if g == 0] == [
        CONV[0] * CONV[1] * 4,
        SSM[0] * SSM[1] * SSM[2] * 4,
    ] * 2
    assert sum(r.block_bytes for r, g in zip(src, owners, strict=True) if g == 0) == 2 * state_bytes

    # P's state block 3 and attention blocks 4, 5; D's state block 7 and attention blocks 8, 9 (33 tokens).
    pairs = group_pairs([[3], [4, 5]], [state_slice([7], 33, MODEL_LEN, 0) or [], [8, 9]], 0)
    slices = slices_from(plan_decode_rank(1, 1, 1, 0, is_mla=False), 0)
    src_a, dst_a, lengths = group_entries(
        owners, src, dst, pairs, lambda s, d, runs: tp_transfer_entries(s, d, slices, 1, 1, runs)
    )
    for s, d, n in zip(src_a, dst_a, lengths, strict=True):
        ctypes.memmove(d, s, n)
    assert sum(lengths) == 2 * state_bytes + 2 * 2 * full.page_size_bytes
    for m in ("m.0", "m.2"):
        for p_part, d_part, before in zip(p_kv[m], d_kv[m], d_before[m], strict=True):
            assert torch.equal(d_part[7], p_part[3])
            others = [b for b in range(num_blocks) if b not in (7, 8, 9)]
            assert torch.equal(d_part[others], before[others])
    for a in ("a.1", "a.3"):
        assert torch.equal(d_kv[a][[8, 9]], p_kv[a][[4, 5]])


def test_the_router_takes_no_first_token_from_a_prefill_without_the_last_token() -> None:
    """P's answer marked PREFILL_WITHOUT_LAST_TOKEN: the first-token path lets D answer from the prompt."""
    from proxy.strategies.first_token_body import parse_first_token

    choice = {"text": "x", "token_ids": [5], "prompt_token_ids": [1, 2, 3], "finish_reason": "length"}
    answer = {"id": "c", "choices": [choice], "kv_transfer_params": {"bootstrap_room": 1, "prefill_done": True}}
    assert parse_first_token(json.dumps(answer).encode()) is not None
    answer["kv_transfer_params"][PREFILL_WITHOUT_LAST_TOKEN] = True
    assert parse_first_token(json.dumps(answer).encode()) is None
