"""External-DP launcher: its process handling, run with a harmless template in place of vLLM.

Exit codes, a rank exiting (with 0 or not) stops the others unless `--keep-going`, SIGTERM reaches
every rank's process group (SIGKILL after the grace period), per-rank logs or inline output, and
independent mode handing each rank its own `--kv-transfer-config`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.launch_dp import KV, REPO

# -- running ranks (with a harmless template) ---------------------------------------------------
FAKE_TEMPLATE = textwrap.dedent(
    """\
    # Test stand-in for run_dp_template.sh: records its arguments, then acts per FAKE_MODE_<rank>.
    rank=$4
    mode_var="FAKE_MODE_$rank"
    # ignore-term: SIGTERM ignored before the pid file tells the test this rank runs
    [ "${!mode_var:-ok}" = ignore-term ] && trap '' TERM
    printf '%s\\n' "$@" > "$FAKE_OUT/args_$rank"
    echo "$$" > "$FAKE_OUT/pid_$rank"
    case ${!mode_var:-ok} in
        ok) exit 0 ;;
        ok-late) sleep 2; exit 0 ;;
        fail) echo "rank $rank: boom"; sleep 1; touch "$FAKE_OUT/failed_$rank"; exit 3 ;;
        sleep) exec sleep 60 ;;
        ignore-term) exec sleep 60 ;;
    esac
    """
)


@pytest.fixture
def fake(tmp_path):
    template = tmp_path / "fake_template.sh"
    template.write_text(FAKE_TEMPLATE)
    return template


def launcher(template: Path, out: Path, modes: dict[int, str], *extra: str) -> subprocess.Popen[str]:
    """Run the launcher (2 local ranks) with `template`; nothing binds the ports (--skip-port-check)."""
    env = dict(os.environ, FAKE_OUT=str(out), **{f"FAKE_MODE_{r}": m for r, m in modes.items()})
    cmd = [
        sys.executable, "-m", "launch.launch_online_dp", "--dp-size", "2", "--dp-address", "127.0.0.1",
        "--dp-rpc-port", "13345", "--vllm-start-port", "18100", "--host", "127.0.0.1",
        "--device", "cpu", "--cpu-bind", "none", "--template", str(template), "--no-health-watch",
        "--skip-port-check", "--model", "m", *extra,
    ]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_files(*paths: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() and p.read_text().strip() for p in paths):
        assert time.monotonic() < deadline, f"not written in time: {paths}"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); look at its state.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"))


def test_launcher_runs_every_rank_and_exits_0_when_they_do(tmp_path, fake):
    proc = launcher(fake, tmp_path, {0: "ok-late", 1: "ok-late"}, "--", "--dtype", "float32")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    for rank in (0, 1):
        args = (tmp_path / f"args_{rank}").read_text().splitlines()
        assert args[3] == str(rank)
        assert args[2] == "2"
        assert args[7:] == ["--dtype", "float32"]
    assert "exited with code 0" in out


def test_launcher_independent_mode_hands_each_rank_its_kv_config(tmp_path, fake):
    # ok-late: a rank that exits at once makes the launcher stop the other, maybe before it wrote its args.
    modes = {0: "ok-late", 1: "ok-late"}
    proc = launcher(fake, tmp_path, modes, "--dp-mode", "independent", "--", "--kv-transfer-config", json.dumps(KV))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "launch_online_dp: dp mode independent (--dp-mode independent)" in out
    assert "independent instances, DP master 127.0.0.1" in out
    for rank in (0, 1):
        args = (tmp_path / f"args_{rank}").read_text().splitlines()
        assert json.loads(args[8])["kv_connector_extra_config"]["dp_rank"] == rank


def test_a_rank_exiting_0_still_stops_the_others(tmp_path, fake):
    # vLLM's API server exits 0 after its engine core died: the DP group is broken all the same.
    proc = launcher(fake, tmp_path, {0: "ok-late", 1: "sleep"}, "--stop-grace-s", "5")
    wait_for_files(tmp_path / "pid_0", tmp_path / "pid_1")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "dp rank 0 exited with code 0" in out
    assert "a rank exited; stopping the others" in out
    assert not alive(int((tmp_path / "pid_1").read_text()))


def test_a_failing_rank_stops_the_others_and_sets_the_exit_code(tmp_path, fake):
    proc = launcher(fake, tmp_path, {0: "sleep", 1: "fail"}, "--stop-grace-s", "5")
    wait_for_files(tmp_path / "pid_0")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert "dp rank 1 exited with code 3" in out
    assert "stopping the others" in out
    assert not alive(int((tmp_path / "pid_0").read_text()))


def test_keep_going_leaves_the_other_ranks_running(tmp_path, fake):
    proc = launcher(fake, tmp_path, {0: "sleep", 1: "fail"}, "--keep-going")
    try:
        wait_for_files(tmp_path / "pid_0")
        deadline = time.monotonic() + 20
        while not (tmp_path / "failed_1").exists():
            assert time.monotonic() < deadline, "rank 1 did not fail in time"
            time.sleep(0.05)
        time.sleep(1.0)  # several launcher polls: it has seen rank 1 exit
        assert proc.poll() is None
        assert alive(int((tmp_path / "pid_0").read_text()))
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "dp rank 1 exited with code 3" in out
    assert not alive(int((tmp_path / "pid_0").read_text()))


def test_sigterm_reaches_every_rank_group_and_sigkill_follows_the_grace_period(tmp_path, fake):
    proc = launcher(fake, tmp_path, {0: "sleep", 1: "ignore-term"}, "--stop-grace-s", "1")
    try:
        wait_for_files(tmp_path / "pid_0", tmp_path / "pid_1")
        pids = [int((tmp_path / f"pid_{r}").read_text()) for r in (0, 1)]
        assert all(alive(p) for p in pids)
        # Each rank leads its own process group (not the launcher's).
        assert {os.getpgid(p) for p in pids} == set(pids)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out
    assert "received SIGTERM" in out
    assert "dp rank 1 did not stop within 1 s; sending SIGKILL" in out
    assert elapsed < 15
    assert not any(alive(p) for p in pids)


def test_log_dir_gets_one_log_per_rank(tmp_path, fake):
    logs = tmp_path / "logs"
    proc = launcher(fake, tmp_path, {0: "ok-late", 1: "ok-late"}, "--log-dir", str(logs))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert sorted(p.name for p in logs.iterdir()) == ["dp_rank_0.log", "dp_rank_1.log"]
    assert f"log {logs / 'dp_rank_0.log'}" in out


def test_a_failing_rank_log_tail_is_shown(tmp_path, fake):
    logs = tmp_path / "logs"
    proc = launcher(fake, tmp_path, {0: "sleep", 1: "fail"}, "--log-dir", str(logs))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert f"last lines of {logs / 'dp_rank_1.log'}:\nrank 1: boom" in out


def test_without_log_dir_each_rank_output_is_inline_with_its_prefix(tmp_path, fake):
    proc = launcher(fake, tmp_path, {0: "sleep", 1: "fail"}, "--stop-grace-s", "5")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert "started dp rank 1 (pid " in out and "output inline" in out
    # The rank's own lines come first, then the launcher's report of its exit.
    assert out.index("[dp rank 1] rank 1: boom\n") < out.index("dp rank 1 exited with code 3")
    assert "last lines of" not in out
