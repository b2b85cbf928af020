"""Per-request path choice on real instances: a request D prefills itself is an ordinary vLLM request and
answers token for token as the PD path (and colocated vLLM) does; the adaptive policy sends work to D
while P is busy.

Real processes: the session's P and D (``pd_stack``) and two more Routers in front of them, one with
``--path-policy always-local`` and one with ``--path-policy adaptive`` (a Router starts in seconds).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from launch.processes import LOOPBACK, PDStack, ProcessGroup, free_port, router_cmd, wait_all_healthy
from tests.support.serving import PROMPT_LENGTHS, complete, prompt_of_length, prompts

pytestmark = [pytest.mark.e2e, pytest.mark.both_lines]

#: Prompt indexes (of ``prompts()``) compared: short and several KV blocks long.
COMPARED = [PROMPT_LENGTHS.index(n) for n in (1, 33, 129, 300)]


@pytest.fixture(scope="module")
def routers(pd_stack: PDStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """URL per policy of two more Routers in front of the session's P and D."""
    prefill = [(LOOPBACK, pd_stack.prefill_port, pd_stack.bootstrap_port)]
    decode = [(LOOPBACK, pd_stack.decode_port)]
    with ProcessGroup(Path(tmp_path_factory.mktemp("path-policy-routers"))) as group:
        urls: dict[str, str] = {}
        for policy in ("always-local", "adaptive"):
            port = free_port()
            proc = group.start(f"router-{policy}", [*router_cmd(port, prefill, decode), "--path-policy", policy])
            urls[policy] = f"http://{LOOPBACK}:{port}"
            wait_all_healthy([(f"{urls[policy]}/health", proc)], 60)
        yield urls


def _paths(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{url}/metrics", timeout=10, trust_env=False).text
    pattern = r'^pd_router_path_total\{path="(\w+)",reason="(\w+)"\} (\S+)$'
    return {(m[1], m[2]): float(m[3]) for m in re.finditer(pattern, text, re.MULTILINE)}


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
def test_local_path_is_token_identical(
    reference: dict, pd_stack: PDStack, routers: dict[str, str], stream: bool
) -> None:
    all_prompts = prompts()
    for i in COMPARED:
        local = complete(routers["always-local"], pd_stack.model, all_prompts[i], stream=stream)
        pd = complete(pd_stack.router_url, pd_stack.model, all_prompts[i], stream=stream)
        want = reference["completions"][stream][i]
        assert local["token_ids"] == pd["token_ids"] == want["token_ids"], f"prompt of {PROMPT_LENGTHS[i]} tokens"
        assert local["text"] == want["text"]
    assert _paths(routers["always-local"]).get(("local", "policy"), 0) >= len(COMPARED)


def test_adaptive_prefills_on_d_while_p_is_busy(pd_stack: PDStack, routers: dict[str, str]) -> None:
    url = routers["adaptive"]
    before = _paths(url)
    alone = complete(url, pd_stack.model, prompt_of_length(200, salt=7), stream=True)
    after_one = _paths(url)
    assert sum(after_one.values()) == sum(before.values()) + 1
    assert after_one.get(("pd", "lower_ttft"), 0) == before.get(("pd", "lower_ttft"), 0) + 1  # P idle: PD
    burst = [prompt_of_length(250, salt=20 + k) for k in range(6)]
    with ThreadPoolExecutor(len(burst)) as pool:
        answers = list(pool.map(lambda p: complete(url, pd_stack.model, p, stream=True), burst))
    # Every answer equals PD's own for its prompt, whichever path it took.
    for prompt, got in zip(burst, answers, strict=True):
        assert got["token_ids"] == complete(pd_stack.router_url, pd_stack.model, prompt, stream=True)["token_ids"]
    counts = _paths(url)
    local = counts.get(("local", "lower_ttft"), 0) - after_one.get(("local", "lower_ttft"), 0)
    remote = sum(v for (path, _), v in counts.items() if path != "local") - sum(
        v for (path, _), v in after_one.items() if path != "local"
    )
    assert local >= 1 and remote >= 1, counts  # the burst split between P and D
    assert alone["token_ids"]
