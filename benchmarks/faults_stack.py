"""The fault campaign's stack (benchmarks/faults.py): the colocated reference, then 2 P + 2 D + the Router.

P0 and D1 run on core 0, P1 and D0 on core 1 (``launch.affinity`` places each whole process tree); the
Router is not placed. Each P's bootstrap server is behind a `BootstrapShim` (the Router is given the
shims' ports), which puts a `ZmtpFaultProxy` in front of each P rank D reaches through it
(``launch.fault_shim``). P and D run with short timeouts (`ROOM_TIMEOUT_S`, `KV_WAIT_TIMEOUT_S`,
`PEER_TIMEOUT_S`) and Mooncake's shortest write timeouts, no auth token (the ZMTP proxy cannot
forward frames signed for P's own endpoint).
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from launch.commands import EAGER_ENV, router_cmd, vllm_env, vllm_serve_cmd
from launch.fault_shim_http import BootstrapShim
from launch.processes import (
    LOOPBACK,
    ManagedProcess,
    ProcessGroup,
    free_port,
    free_ports,
    signal_group,
    wait_all_healthy,
    wait_http_ok,
)
from launch.tiny_model import make_tiny_model
from pd_connector.transfer.mooncake import CALL_TIMEOUT_ENV, CALL_TIMEOUT_FLOOR_S, TCP_PROGRESS_ENV

logger = logging.getLogger("faults")

ROOM_TIMEOUT_S = 6.0
KV_WAIT_TIMEOUT_S = 8.0
PEER_TIMEOUT_S = 3.0
START_TIMEOUT_S = 300.0
#: The Router's total time per request: a request it cannot finish ends with its 504, well within
#: the client's deadline.
ROUTER_REQUEST_TIMEOUT_S = 45.0
CLIENT_DEADLINE_S = 60.0
RESUME_ATTEMPTS = 2
CORES = {"prefill0": "0", "prefill1": "1", "decode0": "1", "decode1": "0"}
_USAGE = re.compile(r"^vllm:kv_cache_usage_perc(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)
_ROOMS = re.compile(r"^vllm:pd_kv_rooms_held(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)


def _fast_env() -> dict[str, str]:
    """Mooncake's shortest write timeouts (as tests.support.serving.FAST_TRANSFER_ENV)."""
    return {CALL_TIMEOUT_ENV: str(CALL_TIMEOUT_FLOOR_S), TCP_PROGRESS_ENV: str(CALL_TIMEOUT_FLOOR_S)}


@dataclass
class Instance:
    name: str
    role: str  # "prefill" | "decode"
    port: int
    cmd: list[str]
    cpus: str
    proc: ManagedProcess
    bootstrap_port: int = 0
    shim: BootstrapShim | None = None
    #: Set while the instance is down (killed, not yet healthy again).
    down: threading.Event = field(default_factory=threading.Event)
    restarts: int = 0
    #: When it was last healthy again after a restart (time.monotonic()).
    up_at: float = 0.0

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


def instance_env(cpus: str) -> dict[str, str]:
    return {**vllm_env(cpus), **_fast_env(), EAGER_ENV: "1"}


def reference_answers(group: ProcessGroup, model: Path, bodies: Sequence[dict]) -> list[str]:
    """One plain `vllm serve` (core 0): the text of each body's greedy answer; stopped before returning."""
    port = free_port()
    os.environ[EAGER_ENV] = "1"
    proc = group.start("colocated", vllm_serve_cmd(model, port), env=instance_env("0"))
    url = f"http://{LOOPBACK}:{port}"
    try:
        wait_http_ok(f"{url}/health", START_TIMEOUT_S, proc)
        out = []
        with httpx.Client(timeout=120, trust_env=False) as client:
            for body in bodies:
                resp = client.post(f"{url}/v1/completions", json={**body, "model": str(model), "stream": False})
                resp.raise_for_status()
                out.append(resp.json()["choices"][0]["text"])
        return out
    finally:
        group.stop(proc)


@dataclass
class Stack:
    group: ProcessGroup
    model: str
    router_port: int
    router: ManagedProcess
    admin_token: str
    instances: list[Instance]
    rng: random.Random
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def router_url(self) -> str:
        return f"http://{LOOPBACK}:{self.router_port}"

    def of_role(self, role: str) -> list[Instance]:
        return [i for i in self.instances if i.role == role]

    @property
    def shims(self) -> list[BootstrapShim]:
        return [i.shim for i in self.instances if i.shim is not None]

    def admin(self, path: str, body: dict, timeout: float) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        return httpx.post(f"{self.router_url}{path}", json=body, headers=headers, timeout=timeout, trust_env=False)

    def any_down(self) -> bool:
        return any(i.down.is_set() for i in self.instances)

    def busy(self, role: str, fallback: int) -> Instance:
        """An instance of ``role`` running a request now (its /metrics), else the ``fallback``-th one."""
        live = [i for i in self.of_role(role) if not i.down.is_set()]
        for inst in live:
            try:
                text = httpx.get(f"{inst.url}/metrics", timeout=2, trust_env=False).text
            except httpx.HTTPError:
                continue
            running = re.search(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+([0-9.]+)$", text, re.M)
            if running and float(running.group(1)) > 0:
                return inst
        return self.of_role(role)[fallback % 2]

    def locate(self, rid: str, timeout: float = 1.5) -> tuple[Instance | None, Instance | None]:
        """The decoder serving the Router's request ``rid`` and the prefiller it loads from (D's log line
        ``req=cmpl-<rid>-... loading N prompt tokens ... from prefill H:<bootstrap shim port>``); Nones
        if D did not log it within ``timeout``."""
        pattern = re.compile(rf"req=cmpl-{re.escape(rid)}-\S*: loading .* from prefill \S+:(\d+)")
        deadline = time.monotonic() + timeout
        while True:
            for inst in self.of_role("decode"):
                path = inst.proc.log_path
                if path is None or not path.exists():
                    continue
                with path.open("rb") as f:
                    f.seek(max(0, path.stat().st_size - 512 * 1024))
                    found = pattern.findall(f.read().decode(errors="replace"))
                if found:
                    port = int(found[-1])
                    prefill = [i for i in self.of_role("prefill") if i.shim is not None and i.shim.port == port]
                    return inst, (prefill[0] if prefill else None)
            if time.monotonic() > deadline:
                return None, None
            time.sleep(0.05)

    def kill(self, inst: Instance) -> bool:
        """SIGKILL ``inst``'s process group and restart it in the background; False if one of its role is down."""
        if any(i.down.is_set() for i in self.of_role(inst.role)):
            return False
        inst.down.set()
        logger.warning("fault: SIGKILL %s (pid %d)", inst.name, inst.proc.pid)
        signal_group(inst.proc.pid, signal.SIGKILL)
        inst.proc.popen.wait(timeout=10)
        self.group.stop(inst.proc, grace_s=2)
        threading.Thread(target=self._restart, args=(inst,), name=f"restart-{inst.name}", daemon=True).start()
        return True

    def _restart(self, inst: Instance) -> None:
        inst.restarts += 1
        inst.proc = self.group.start(inst.name, inst.cmd, env=instance_env(inst.cpus))
        try:
            wait_http_ok(f"{inst.url}/health", START_TIMEOUT_S, inst.proc)
            logger.info("%s restarted and healthy", inst.name)
        except Exception:
            logger.exception("%s did not come back", inst.name)
            return
        inst.up_at = time.monotonic()
        inst.down.clear()

    def freeze(self, inst: Instance, seconds: float) -> bool:
        if inst.down.is_set():
            return False
        logger.warning("fault: SIGSTOP %s for %.1f s", inst.name, seconds)
        signal_group(inst.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            signal_group(inst.proc.pid, signal.SIGCONT)
        return True

    def wait_all_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.any_down() and time.monotonic() < deadline:
            time.sleep(0.5)


def start_stack(group: ProcessGroup, model: Path, rng: random.Random, token_dir: Path) -> Stack:
    """2 P + 2 D + the Router (resume on), every P's bootstrap server behind a fault shim; all healthy."""
    ports = free_ports(7)
    common = {"peer_timeout_s": PEER_TIMEOUT_S}
    instances = []
    for k in range(2):
        port, boot = ports[2 * k], ports[2 * k + 1]
        name = f"prefill{k}"
        cfg = {**common, "room_timeout_s": ROOM_TIMEOUT_S}
        cmd = vllm_serve_cmd(model, port, kv_role="kv_producer", bootstrap_port=boot, extra_config=cfg)
        proc = group.start(name, cmd, env=instance_env(CORES[name]))
        inst = Instance(name, "prefill", port, cmd, CORES[name], proc, bootstrap_port=boot)
        inst.shim = BootstrapShim((LOOPBACK, boot), random.Random(rng.random()))
        instances.append(inst)
    for k in range(2):
        port, name = ports[4 + k], f"decode{k}"
        # D's bootstrap_port is unused (it reads the one each request names); P0's keeps the config complete
        cfg = {**common, "kv_wait_timeout_s": KV_WAIT_TIMEOUT_S}
        cmd = vllm_serve_cmd(model, port, kv_role="kv_consumer", bootstrap_port=ports[1], extra_config=cfg)
        proc = group.start(name, cmd, env=instance_env(CORES[name]))
        instances.append(Instance(name, "decode", port, cmd, CORES[name], proc))
    router_port = ports[6]
    token = "faults-" + random.Random(rng.random()).randbytes(12).hex()
    token_file = token_dir / "router-admin-token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    prefill = [(LOOPBACK, i.port, i.shim.port) for i in instances if i.shim is not None]
    decode = [(LOOPBACK, i.port) for i in instances if i.role == "decode"]
    r_cmd = [
        *router_cmd(router_port, prefill, decode),
        *("--resume-attempts", str(RESUME_ATTEMPTS), "--health-interval", "1"),
        *("--request-timeout", str(ROUTER_REQUEST_TIMEOUT_S), "--admin-token-file", str(token_file)),
    ]
    router_env = dict(os.environ, PYTHONUNBUFFERED="1")
    router_env.setdefault("PD_ROUTER_PATH_POLICY", "always-pd")
    router = group.start("router", r_cmd, env=router_env, cpus="")
    wait_all_healthy([(f"{i.url}/health", i.proc) for i in instances], START_TIMEOUT_S, watch=[router])
    wait_http_ok(f"http://{LOOPBACK}:{router_port}/health", 60, router)
    return Stack(group, str(model), router_port, router, token, instances, rng)


def tiny_model(where: Path) -> Path:
    return make_tiny_model(where / "tiny-llama")


def gauges(url: str) -> tuple[float, float] | None:
    """(vLLM's KV cache usage, PDConnector's rooms held summed over ranks) of ``url``; None if unreachable."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5, trust_env=False).text
    except httpx.HTTPError:
        return None
    usage = max((float(v) for v in _USAGE.findall(text)), default=0.0)
    rooms = sum(float(v) for v in _ROOMS.findall(text))
    return usage, rooms
