"""Command lines and environments of the processes of a local PD deployment on this CPU machine.

`vllm_serve_cmd` (one `vllm serve`, with a PDConnector `--kv-transfer-config` for P or D),
`vllm_env` (its CPU cores and KV-cache size) and `router_cmd` (the Router, `python -m proxy`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from launch.ports import LOOPBACK

#: Set to "1", every `vllm serve` built here runs with --enforce-eager: no torch.compile at start-up
#: (~8 s less per start on this machine). The e2e tests set it for every instance they start, the
#: colocated reference included, so their token-for-token comparisons compare like with like.
EAGER_ENV = "PDC_ENFORCE_EAGER"

#: ASGI middleware that answers HTTP 400 to malformed `kv_transfer_params` (pd_connector).
KV_PARAMS_MIDDLEWARE = "pd_connector.api_server.validation.KVParamsValidationMiddleware"


def vllm_serve_cmd(
    model: str | Path,
    port: int,
    *,
    kv_role: str | None = None,
    bootstrap_port: int | None = None,
    extra_config: Mapping[str, Any] | None = None,
    extra_args: Sequence[str] = (),
    served_model_name: str | None = None,
    host: str = LOOPBACK,
    validate_kv_params: bool = True,
) -> list[str]:
    """Command line of one `vllm serve` of `model` on this CPU machine (via `launch.vllm_cli`).

    With `kv_role` ("kv_producer" for P, "kv_consumer" for D, "kv_both" for either) it adds a PDConnector
    `--kv-transfer-config` (`extra_config` entries are merged into `kv_connector_extra_config`)
    and, unless `validate_kv_params` is False, the `--middleware` that rejects malformed
    `kv_transfer_params` with HTTP 400.
    """
    cmd = [
        sys.executable,
        "-m",
        "launch.vllm_cli",
        "serve",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--max-model-len",
        "2048",
    ]
    if os.environ.get(EAGER_ENV) == "1":
        cmd.append("--enforce-eager")  # no torch.compile warm-up (the e2e tests: every instance, reference too)
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if kv_role is not None:
        if kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(f"kv_role must be 'kv_producer', 'kv_consumer' or 'kv_both', not {kv_role!r}")
        extra: dict[str, Any] = {"bootstrap_port": bootstrap_port, "local_ip": host, "protocol": "tcp"}
        extra.update(extra_config or {})
        kv_config = {"kv_connector": "PDConnector", "kv_role": kv_role, "kv_connector_extra_config": extra}
        cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        if validate_kv_params:
            cmd += ["--middleware", KV_PARAMS_MIDDLEWARE]
    cmd += list(extra_args)
    return cmd


def vllm_env(cpu_bind: str, kv_space_gib: int = 1) -> dict[str, str]:
    """Environment for one vLLM CPU instance: its own cores and a small KV cache.

    `ProcessGroup.start` places a process started with this environment, its whole tree, on
    `cpu_bind`'s cores (all TP groups together), not only its OpenMP threads.
    """
    env = dict(os.environ)
    env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def router_cmd(
    port: int,
    prefill: Sequence[tuple[str, int, int]],
    decode: Sequence[tuple[str, int]],
    *,
    host: str = LOOPBACK,
) -> list[str]:
    """Command line of the Router (`python -m proxy`).

    `prefill` is [(host, http_port, bootstrap_port)], `decode` is [(host, http_port)].
    """
    if not prefill or not decode:
        raise ValueError("the Router needs at least one prefill and one decode instance")
    return [
        sys.executable,
        "-m",
        "proxy",
        "--host",
        host,
        "--port",
        str(port),
        "--prefiller-hosts",
        *[h for h, _, _ in prefill],
        "--prefiller-ports",
        *[str(p) for _, p, _ in prefill],
        "--prefiller-bootstrap-ports",
        *[str(b) for _, _, b in prefill],
        "--decoder-hosts",
        *[h for h, _ in decode],
        "--decoder-ports",
        *[str(p) for _, p in decode],
    ]
