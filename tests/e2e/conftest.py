"""End-to-end fixtures: real `vllm serve` processes of the tiny model on loopback ports.

- `reference`: the answers of one plain vLLM server (no connector, CPU 0), computed once per test
  run and stopped before anything else starts: greedy completions and chat, seeded samples.
- `pd_stack`: a prefill instance (CPU 0), a decode instance (CPU 1) and the Router, with
  short connector timeouts (`P_ROOM_TIMEOUT_S`, `D_KV_WAIT_TIMEOUT_S`).

Both are session-scoped (each start-up costs about a minute here) and owned by a
`ProcessGroup`, which stops every process by process group when the session ends, whether
the tests passed or failed, and also on SIGINT/SIGTERM. Tests using them must be marked
`pytest.mark.e2e`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.commands import EAGER_ENV
from launch.processes import (
    PDStack,
    ProcessGroup,
    free_port,
    start_pd_stack,
    vllm_env,
    vllm_serve_cmd,
    wait_http_ok,
)
from launch.vllm_cli import installed_vllm_version
from tests.support.serving import D_KV_WAIT_TIMEOUT_S, P_ROOM_TIMEOUT_S, START_TIMEOUT_S

# Every vLLM instance the e2e tests start (the colocated reference too) runs eager: no torch.compile
# warm-up per start (launch.commands.EAGER_ENV); tests that build their own `vllm serve` arguments add
# --enforce-eager themselves.
os.environ[EAGER_ENV] = "1"


# On the vLLM 0.23 line, torch.compile is off in every process the tests start (inherited): vLLM 0.23's CPU
# sampler compiles one helper in its start-up warm-up even with --enforce-eager, and inductor's compiler probe
# of each vector ISA (a g++ build and a Python child per ISA) cost about 30 s of each 0.23 instance's start on an
# AMX Xeon (22 s start instead of 55 s). Not on 0.32: its eager start compiles nothing, and an instance started
# without --enforce-eager (the example script's) needs torch.compile (0.32's aot_compile refuses it disabled).
with contextlib.suppress(ImportError):  # no vLLM installed at all: nothing to switch off
    if installed_vllm_version().startswith("0.23."):
        os.environ["TORCHDYNAMO_DISABLE"] = "1"


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


@pytest.fixture(scope="session")
def pd_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDStack]:
    """Prefill (kv_producer, CPU 0) + decode (kv_consumer, CPU 1) + Router, all healthy."""
    for module in ("pd_connector.connector", "proxy.__main__"):
        if not _module_exists(module):
            pytest.fail(f"{module} does not exist: the P/D stack cannot start")
    log_dir = tmp_path_factory.mktemp("pd-logs")
    with ProcessGroup(log_dir) as group:
        yield start_pd_stack(
            group,
            tiny_model,
            extra_p_config={"room_timeout_s": P_ROOM_TIMEOUT_S},
            extra_d_config={"kv_wait_timeout_s": D_KV_WAIT_TIMEOUT_S},
            timeout=START_TIMEOUT_S,
        )


@pytest.fixture(scope="session")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A colocated `vllm serve`'s greedy outputs for every test prompt (stream and not) and seeded samples.

    The server is stopped before this fixture returns, so it never competes with the P/D
    processes for this machine's two cores.
    """
    from tests.support.serving import (
        BLOCK_SIZE,
        CHAT_PROMPTS,
        PROMPT_LENGTHS,
        SAMPLES,
        chat,
        complete,
        prompts,
        sampled,
    )

    assert len(PROMPT_LENGTHS) >= 20 and max(PROMPT_LENGTHS) > 4 * BLOCK_SIZE and min(PROMPT_LENGTHS) == 1
    with ProcessGroup(tmp_path_factory.mktemp("reference-logs")) as group:
        port = free_port()
        proc = group.start("colocated", vllm_serve_cmd(tiny_model, port), env=vllm_env("0"))
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(f"{url}/health", START_TIMEOUT_S, proc)
        model = str(tiny_model)
        return {
            "completions": {s: [complete(url, model, p, stream=s) for p in prompts()] for s in (False, True)},
            "chat": {s: [chat(url, model, c, stream=s) for c in CHAT_PROMPTS] for s in (False, True)},
            "samples": {n: sampled(url, model, n) for n in SAMPLES},
        }
