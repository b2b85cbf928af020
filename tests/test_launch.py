"""Unit tests of `launch.processes` (fast: no vLLM start-up)."""

from __future__ import annotations

import importlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launch.ports import PICK_RANGE
from launch.processes import (
    KV_PARAMS_MIDDLEWARE,
    ProcessFailed,
    ProcessGroup,
    free_port,
    free_ports,
    group_members,
    port_in_use,
    router_cmd,
    vllm_env,
    vllm_serve_cmd,
    wait_http_ok,
    watch_health,
)

# A parent that spawns a child which ignores SIGTERM, prints both pids, then sleeps.
SPAWNER = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    print(os.getpid(), child.pid, flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _read_pids(log: Path, timeout: float = 10.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if text.strip():
            parent, child = text.split()[:2]
            return int(parent), int(child)
        time.sleep(0.05)
    raise AssertionError(f"spawner printed nothing; log: {log.read_text() if log.exists() else ''}")


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_free_ports_are_distinct() -> None:
    ports = free_ports(4)
    assert len(set(ports)) == 4


def test_free_ports_stay_out_of_the_ephemeral_range_and_are_not_handed_out_twice() -> None:
    """Outgoing connections take their local ports from the kernel's ephemeral range (32768 on here):
    a port picked there could be taken between the pick and a server's bind."""
    ports = free_ports(20) + [free_port() for _ in range(20)]
    low, high = PICK_RANGE
    assert all(low <= port < high for port in ports), ports
    assert len(set(ports)) == len(ports)


def test_group_stops_process_group_with_child(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path, stop_grace_s=1.0) as group:
        proc = group.start("spawner", [sys.executable, "-c", SPAWNER])
        parent, child = _read_pids(proc.log_path)
        assert parent == proc.pid
        assert _alive(child)
        assert os.getpgid(child) == proc.pid  # the child shares the new session's group
        assert os.getsid(proc.pid) == proc.pid
    # The child ignored SIGTERM: only the SIGKILL to the whole group can have stopped it.
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(parent)
    assert not _alive(child)
    assert group_members(proc.pid) == []
    assert group.processes == []


def test_group_stops_on_exception(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"), ProcessGroup(tmp_path) as group:
        proc = group.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
        raise RuntimeError("boom")
    assert proc.poll() is not None
    assert group_members(proc.pid) == []


def test_sigterm_stops_children(tmp_path: Path) -> None:
    """A script holding a ProcessGroup, sent SIGTERM, leaves no child behind."""
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        from launch.processes import ProcessGroup
        with ProcessGroup({str(tmp_path / "logs")!r}, stop_grace_s=1.0) as group:
            p = group.start("spawner", [sys.executable, "-c", {SPAWNER!r}])
            print(p.pid, flush=True)
            time.sleep(600)
        """
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        spawner_pid = int(holder.stdout.readline())
        _, child = _read_pids(tmp_path / "logs" / "spawner.log")
        assert _alive(child)
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=15) == 128 + signal.SIGTERM
        assert not _alive(spawner_pid)
        assert not _alive(child)
    finally:
        if holder.poll() is None:
            holder.kill()


def test_nested_groups_all_stop_on_sigterm(tmp_path: Path) -> None:
    """SIGTERM reaches the outer group's processes too, not only the innermost group's."""
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        from launch.processes import ProcessGroup
        sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
        with ProcessGroup({str(tmp_path / "outer")!r}) as outer:
            a = outer.start("a", sleep)
            with ProcessGroup({str(tmp_path / "inner")!r}) as inner:
                b = inner.start("b", sleep)
                print(a.pid, b.pid, flush=True)
                time.sleep(600)
        """
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        pids = [int(x) for x in holder.stdout.readline().split()]
        assert all(_alive(pid) for pid in pids)
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=30) == 128 + signal.SIGTERM
        assert not any(_alive(pid) for pid in pids)
    finally:
        if holder.poll() is None:
            holder.kill()


def test_wait_http_ok_reports_exited_process(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path) as group:
        proc = group.start("crasher", [sys.executable, "-c", "import sys; print('about to fail'); sys.exit(3)"])
        with pytest.raises(ProcessFailed) as info:
            wait_http_ok(f"http://127.0.0.1:{free_port()}/health", timeout=20, proc=proc)
    message = str(info.value)
    assert "crasher" in message
    assert "code 3" in message
    assert "about to fail" in message


def test_wait_http_ok_times_out() -> None:
    t0 = time.monotonic()
    with pytest.raises(ProcessFailed, match="not ready"):
        wait_http_ok(f"http://127.0.0.1:{free_port()}/health", timeout=1.0, interval=0.1)
    assert time.monotonic() - t0 < 10


def test_vllm_serve_cmd_plain() -> None:
    cmd = vllm_serve_cmd("/m", 8100)
    assert cmd[:5] == [sys.executable, "-m", "launch.vllm_cli", "serve", "/m"]
    for flag, value in [
        ("--host", "127.0.0.1"),
        ("--port", "8100"),
        ("--dtype", "float32"),
        ("--block-size", "32"),
        ("--max-model-len", "2048"),
    ]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--kv-transfer-config" not in cmd
    assert "--served-model-name" not in cmd
    assert "--middleware" not in cmd


def test_vllm_serve_cmd_runs_eager_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from launch.commands import EAGER_ENV

    monkeypatch.delenv(EAGER_ENV, raising=False)
    assert "--enforce-eager" not in vllm_serve_cmd("/m", 8100)
    monkeypatch.setenv(EAGER_ENV, "1")
    assert vllm_serve_cmd("/m", 8100).count("--enforce-eager") == 1


def test_vllm_serve_cmd_kv_config() -> None:
    cmd = vllm_serve_cmd(
        "/m",
        8100,
        kv_role="kv_producer",
        bootstrap_port=8998,
        extra_config={"timeout_s": 5, "protocol": "rdma"},
        extra_args=["--enforce-eager"],
        served_model_name="tiny",
    )
    config = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert config == {
        "kv_connector": "PDConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "bootstrap_port": 8998,
            "local_ip": "127.0.0.1",
            "protocol": "rdma",
            "timeout_s": 5,
        },
    }
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny"
    assert cmd[cmd.index("--middleware") + 1] == KV_PARAMS_MIDDLEWARE
    assert cmd[-1] == "--enforce-eager"
    no_check = vllm_serve_cmd("/m", 8100, kv_role="kv_consumer", bootstrap_port=1, validate_kv_params=False)
    assert "--middleware" not in no_check


def test_kv_params_middleware_importable() -> None:
    module, name = KV_PARAMS_MIDDLEWARE.rsplit(".", 1)
    assert hasattr(importlib.import_module(module), name)


def test_vllm_serve_cmd_rejects_unknown_role() -> None:
    with pytest.raises(ValueError):
        vllm_serve_cmd("/m", 8100, kv_role="kv_either")


def test_vllm_env() -> None:
    env = vllm_env("1", kv_space_gib=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env.get("PATH") == os.environ.get("PATH")


def test_router_cmd() -> None:
    cmd = router_cmd(9000, prefill=[("127.0.0.1", 8100, 8998)], decode=[("127.0.0.1", 8200)])
    assert cmd == [
        sys.executable,
        "-m",
        "proxy",
        "--host",
        "127.0.0.1",
        "--port",
        "9000",
        "--prefiller-hosts",
        "127.0.0.1",
        "--prefiller-ports",
        "8100",
        "--prefiller-bootstrap-ports",
        "8998",
        "--decoder-hosts",
        "127.0.0.1",
        "--decoder-ports",
        "8200",
    ]


def test_port_in_use() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert port_in_use("127.0.0.1", sock.getsockname()[1])
    assert not port_in_use("127.0.0.1", free_port())


def test_echo_prefixes_each_line_on_the_console_and_keeps_the_log(tmp_path: Path) -> None:
    console = io.StringIO()
    script = "import sys; print('one'); print('two', file=sys.stderr, flush=True); sys.stdout.write('three')"
    with ProcessGroup(tmp_path, console=console) as group:
        both = group.start("both", [sys.executable, "-c", script], echo="[a] ")
        assert [code for _, code in group.wait()] == [0]
    lines = console.getvalue().splitlines()
    assert sorted(lines) == ["[a] one", "[a] three", "[a] two"]
    assert both.log_path == tmp_path / "both.log"
    assert sorted(both.log_path.read_text().split()) == ["one", "three", "two"]


def test_echo_without_a_log_file(tmp_path: Path) -> None:
    console = io.StringIO()
    with ProcessGroup(tmp_path / "logs", console=console) as group:
        proc = group.start("quiet", [sys.executable, "-c", "print('hi'); raise SystemExit(4)"], log=False, echo="> ")
        assert group.wait() == [(proc, 4)]
    assert console.getvalue() == "> hi\n"
    assert proc.log_path is None
    assert proc.log_tail() == ""
    assert "no log file" in proc.describe_failure("exited with code 4")
    assert list((tmp_path / "logs").iterdir()) == []


def test_wait_first_returns_at_the_first_exit_and_reports_it(tmp_path: Path) -> None:
    said: list[str] = []
    seen: list[tuple[str, int]] = []
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    with ProcessGroup(tmp_path, report=said.append, stop_grace_s=5.0) as group:
        sleeper = group.start("sleeper", sleep, label="the sleeper")
        quitter = group.start("quitter", [sys.executable, "-c", "raise SystemExit(3)"], label="the quitter")
        exits = group.wait(first=True, interval=0.05, on_exit=lambda p, code: seen.append((p.name, code)))
        assert exits == [(quitter, 3)]
        assert seen == [("quitter", 3)]
        assert sleeper.is_running()
    assert not sleeper.is_running()
    assert "the quitter exited with code 3" in said
    assert f"stopping the sleeper (process group {sleeper.pid})" in said


def test_custom_signals_stop_the_group_with_128_plus_n(tmp_path: Path) -> None:
    """SIGHUP, when listed in `signals`, stops every process; the holder exits 128 + 1."""
    script = textwrap.dedent(
        f"""
        import signal, sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        from launch.processes import ProcessGroup
        signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        with ProcessGroup({str(tmp_path)!r}, signals=signals, report=print) as group:
            p = group.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
            print(p.pid, flush=True)
            group.wait()
        """
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        pid = int(holder.stdout.readline())
        holder.send_signal(signal.SIGHUP)
        assert holder.wait(timeout=15) == 128 + signal.SIGHUP
        assert "received SIGHUP; stopping 1 process(es)" in holder.stdout.read()
        assert not _alive(pid)
    finally:
        if holder.poll() is None:
            holder.kill()


def test_watch_health_reports_healthy_targets_and_drops_exited_ones(tmp_path: Path) -> None:
    server = textwrap.dedent(
        """
        import http.server, sys
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()
        http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
        """
    )
    port = free_port()
    healthy: list[int] = []
    with ProcessGroup(tmp_path) as group:
        up = group.start("up", [sys.executable, "-c", server, str(port)])
        gone = group.start("gone", [sys.executable, "-c", "raise SystemExit(1)"])
        targets = [(f"http://127.0.0.1:{free_port()}/health", gone), (f"http://127.0.0.1:{port}/health", up)]
        t0 = time.monotonic()
        watch_health(targets, healthy.append, interval=0.1)
        assert time.monotonic() - t0 < 30
    assert healthy == [1]
