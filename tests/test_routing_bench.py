"""benchmarks/routing.py's parts that need no vLLM: the chat trace, P's counters, the streaming client."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx

from benchmarks import routing
from launch.processes import ProcessGroup, free_ports, wait_http_ok

REPO = Path(__file__).resolve().parent.parent
METRICS = """# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 24.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 512.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e+09
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 99.0
"""


def test_conversations_are_seeded_with_their_own_system_prompts() -> None:
    texts = routing.conversation_texts(0, 8, 4, 800, 200)
    assert texts == routing.conversation_texts(0, 8, 4, 800, 200)
    assert len(texts) == 8 and all(len(t) == 5 for t in texts)
    assert all(len(t[0]) == 800 and all(len(q) == 200 for q in t[1:]) for t in texts)
    assert len({t[0][:40] for t in texts}) == 8  # prefixes differ from the first characters on


def test_prefix_counters_sum_every_engine_and_skip_other_series() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=METRICS))
    with httpx.Client(transport=transport) as client:
        assert routing.prefix_counters(client, "http://p") == {"queries": 1024.0, "hits": 512.0}


def test_trace_resends_the_history_and_times_first_events(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    fake = [sys.executable, str(REPO / "tests" / "support" / "fake_backend.py"), "--port", str(port)]
    with ProcessGroup(tmp_path) as group:
        proc = group.start("fake", fake)
        wait_http_ok(f"http://127.0.0.1:{port}/health", 60.0, proc)
        texts = routing.conversation_texts(1, 2, 3, 100, 20)
        stats = asyncio.run(routing.run_trace(f"http://127.0.0.1:{port}", "fake-model", texts, 4))
        sent = httpx.get(f"http://127.0.0.1:{port}/stats", trust_env=False).json()["requests"]
    assert stats.failed == 0 and len(stats.ttft_s) == 6 and all(t > 0 for t in stats.ttft_s)
    third = [r["body"]["messages"] for r in sent if len(r["body"]["messages"]) == 6]
    assert len(third) == 2  # system, then question / answer twice, then the third question
    assert third[0][2] == {"role": "assistant", "content": "Hello, world!"}
    assert all(r["body"]["stream"] is True and r["body"]["ignore_eos"] is True for r in sent)
