"""D2RH mode end to end (pd_connector.d2rh.scheduler): one P, one D with ``d2rh: true`` (vLLM-Ascend's
port keys given too), the Router in front; D runs without its own prefix cache, so a repeated prompt
can only come from D's host KV pool.

- token identity with colocated vLLM (``reference``), streamed (the Router's first-token path) and not;
- no device block of a request is held on D while its transfer is in flight: D is asked first and P's
  prefill comes only seconds later (D's staging waits on P all that time), and vLLM's own
  ``vllm:kv_cache_usage_perc`` on D stays 0 until the push landed in the host pool;
- a repeated prompt is loaded from the host pool: P pushes no byte for it (its ``pd_kv_sent_bytes``
  does not move, its room is released), D's ``pd_kv_host_hit_blocks`` counts every full block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.processes import PDStack, ProcessGroup, start_pd_stack
from pd_connector.kv_params import DecodeParams, PrefillParams
from pd_connector.metrics import METRIC_NAMES
from tests.support.metrics import metric, wait_metric
from tests.support.serving import (
    BLOCK_SIZE,
    P_ROOM_TIMEOUT_S,
    PROMPT_LENGTHS,
    START_TIMEOUT_S,
    assert_matches_reference,
    complete,
    kv_usage,
    prompts,
)

pytestmark = [pytest.mark.e2e, pytest.mark.vllm023]  # the line vLLM-Ascend 0.23 (and D2RH) runs on

HOST_POOL_BLOCKS = 128
STAGE_WAIT_S = 3.0  # how long D's transfer stays in flight before P's prefill comes
HITS = METRIC_NAMES["host_hit_blocks"] + "_total"
SENT = METRIC_NAMES["bytes_sent"] + "_total"


@pytest.fixture(scope="module")
def d2rh_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDStack]:
    d_config = {
        "kv_wait_timeout_s": 30.0,
        "d2rh": True,
        "host_pool_blocks": HOST_POOL_BLOCKS,
        "d2rh_zmq_port": 38100,  # vLLM-Ascend's keys: accepted, no socket opened
        "d2rh_scheduler_ready_port": 38200,
    }
    with ProcessGroup(tmp_path_factory.mktemp("d2rh-logs")) as group:
        yield start_pd_stack(
            group,
            tiny_model,
            extra_p_config={"room_timeout_s": P_ROOM_TIMEOUT_S},
            extra_d_config=d_config,
            d_args=["--no-enable-prefix-caching"],
            timeout=START_TIMEOUT_S,
        )


def test_token_identical_to_colocated(d2rh_stack: PDStack, reference: dict) -> None:
    indices = [PROMPT_LENGTHS.index(n) for n in (1, 32, 65, 200)]
    made = assert_matches_reference(d2rh_stack.router_url, d2rh_stack.model, reference, indices, "D2RH")
    assert made == 2 * len(indices)
    assert "D2RH host KV pool" in d2rh_stack.decode.log_path.read_text(errors="replace")


def test_no_device_block_held_while_the_transfer_is_in_flight(d2rh_stack: PDStack, reference: dict) -> None:
    s = d2rh_stack
    i = PROMPT_LENGTHS.index(257)  # 9 blocks
    prompt, room = prompts()[i], 424242
    answer: dict = {}

    def decode() -> None:
        params = DecodeParams(room, s.host, s.bootstrap_port, 0).to_json()
        answer.update(complete(s.decode_url, s.model, prompt, stream=False, kv_transfer_params=params))

    before = kv_usage(s.decode_url)
    thread = threading.Thread(target=decode)
    thread.start()
    samples = []
    deadline = time.monotonic() + STAGE_WAIT_S
    while time.monotonic() < deadline:  # D asked P; P has not prefilled: the transfer is in flight
        samples.append(kv_usage(s.decode_url))
        time.sleep(0.1)
    waiting = metric(s.decode_url, METRIC_NAMES["loads_waiting"])
    p_answer = complete(s.prefill_url, s.model, prompt, stream=False, max_tokens=1,
                        kv_transfer_params=PrefillParams(room).to_json())  # fmt: skip
    thread.join(60)
    assert not thread.is_alive()
    print(f"[d2rh] D's KV usage while its transfer was in flight: {len(samples)} samples, max {max(samples)}; "
          f"loads waiting {waiting}")  # fmt: skip
    assert before == 0.0 and max(samples) == 0.0 and len(samples) >= 3  # /metrics takes ~0.5 s on a busy machine
    assert waiting == 1  # the load was in flight all that time
    assert p_answer["token_ids"]
    assert answer["token_ids"] == reference["completions"][False][i]["token_ids"]


def test_a_repeat_is_loaded_from_the_host_pool_without_prefill_pushing(d2rh_stack: PDStack, reference: dict) -> None:
    s = d2rh_stack
    indices = [PROMPT_LENGTHS.index(n) for n in (129, 160)]  # 4 full blocks + 1 token; 5 full blocks
    for i in indices:  # first time: staged from P, full blocks cached in D's host pool
        assert complete(s.router_url, s.model, prompts()[i], stream=False)["token_ids"]
    time.sleep(1.0)  # P's stats of those pushes reach its /metrics
    hits0, sent0 = metric(s.decode_url, HITS), metric(s.prefill_url, SENT)
    assert_matches_reference(s.router_url, s.model, reference, indices, "D2RH repeat")
    full_blocks = sum(PROMPT_LENGTHS[i] // BLOCK_SIZE for i in indices)
    hits = wait_metric(s.decode_url, HITS, hits0 + 2 * full_blocks) - hits0
    time.sleep(1.0)
    sent = metric(s.prefill_url, SENT) - sent0
    print(f"[d2rh] repeats: {hits:.0f} blocks from D's host pool (want {2 * full_blocks}), P pushed {sent:.0f} bytes")
    assert hits == 2 * full_blocks  # streamed and not, each prompt
    assert sent == 0  # P was not asked for a byte
    deadline = time.monotonic() + 15
    while metric(s.prefill_url, METRIC_NAMES["rooms_held"]) > 0:  # D released the rooms it did not need
        assert time.monotonic() < deadline, "P still holds rooms D loaded from its host pool"
        time.sleep(0.25)
