"""kv_role kv_both end to end: two instances that each prefill for the other and decode what the other
prefilled, at the same time, token-identical to one colocated vLLM.

Two kv_both instances (CPU 0 and CPU 1, each with its own bootstrap server) behind the Router as
``--both-hosts``. With ``--routing room`` and client rooms (``--trust-client-room``), an even room
prefills on the first instance and decodes on the second, an odd room the other way round (the Router
never pairs an instance with itself). Requests of both directions run concurrently; each instance's
``/metrics`` must then count KV pushes (it was P) and KV loads (it was D).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from launch.processes import BothStack, ProcessGroup, start_both_stack
from tests.support.metrics import metric, wait_metric
from tests.support.serving import (
    D_KV_WAIT_TIMEOUT_S,
    P_ROOM_TIMEOUT_S,
    PROMPT_LENGTHS,
    START_TIMEOUT_S,
    complete,
    kv_usage,
    prompts,
    wait_kv_free,
)

pytestmark = [pytest.mark.e2e, pytest.mark.vllm023]  # the line vLLM-Ascend 0.23 runs; passes on 0.32 too

#: Prompt lengths sent (several blocks of 32 tokens, partial last blocks included), two per direction and mode.
LENGTHS = (33, 65, 129, 200, 47, 96, 160, 300)


@pytest.fixture(scope="module")
def both_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BothStack]:
    with ProcessGroup(tmp_path_factory.mktemp("pd-both-logs")) as group:
        yield start_both_stack(
            group,
            tiny_model,
            extra_config={"room_timeout_s": P_ROOM_TIMEOUT_S, "kv_wait_timeout_s": D_KV_WAIT_TIMEOUT_S},
            timeout=START_TIMEOUT_S,
            router_args=["--trust-client-room", "--routing", "room"],
        )


def _pair_of(stack: BothStack, room: int, timeout: float = 10.0) -> tuple[str, str]:
    """The prefiller and decoder of the request in ``room``, from the Router's line about it."""
    pattern = re.compile(rf"room={room} POST \S+ stream=\w+ path=\S+ P=(\S+) D=(\S+)")
    deadline = time.monotonic() + timeout
    while not (found := pattern.findall(stack.router.log_path.read_text(errors="replace"))):
        assert time.monotonic() < deadline, f"no Router line for room {room}"
        time.sleep(0.2)
    (pair,) = found
    return pair


def test_both_instances_prefill_for_each_other_concurrently(reference: dict, both_stack: BothStack) -> None:
    urls = both_stack.urls
    before = {url: (metric(url, "vllm:pd_kv_pushes_total"), metric(url, "vllm:pd_kv_loads_total")) for url in urls}
    texts = prompts()
    jobs = []  # (prompt index, stream, room): room parity picks the direction
    for n, length in enumerate(LENGTHS):
        jobs.append((PROMPT_LENGTHS.index(length), n % 4 >= 2, 7000 + n))

    def run(job: tuple[int, bool, int]) -> list[int]:
        index, stream, room = job
        got = complete(both_stack.router_url, both_stack.model, texts[index], stream=stream, bootstrap_room=room)
        return got["token_ids"]

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(run, jobs))
    for (index, stream, room), token_ids in zip(jobs, answers, strict=True):
        want = reference["completions"][stream][index]["token_ids"]
        assert token_ids == want, f"prompt of {PROMPT_LENGTHS[index]} tokens, stream={stream}, room {room}"
    for room in [room for _, _, room in jobs]:  # the Router's line of each request: P and D, two instances
        p, d = _pair_of(both_stack, room)
        assert p != d and "-" not in (p, d), f"room {room}: P={p} D={d}"
    half = len(jobs) // 2
    for url in urls:  # each instance was P for half of the rooms and D for the other half
        pushes = wait_metric(url, "vllm:pd_kv_pushes_total", before[url][0] + half) - before[url][0]
        loads = wait_metric(url, "vllm:pd_kv_loads_total", before[url][1] + half) - before[url][1]
        assert pushes >= half and loads >= half, f"{url}: {pushes} pushes, {loads} loads as P and D"
        assert wait_kv_free(url) == 0.0, f"{url} still holds KV: {kv_usage(url)}"
