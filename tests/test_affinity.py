"""Whole-instance CPU placement: a started process AND its children run on the instance's cores.

Read back from /proc/PID/status (Cpus_allowed_list) of real processes: one started by
`ProcessGroup` (explicit `cpus`, or taken from `vllm_env`'s VLLM_CPU_OMP_THREADS_BIND), and the
ranks of `launch_online_dp --cpu-bind` with a harmless template that forks a child.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launch.affinity import allowed_cpus, format_cpus, instance_cpus, parse_cpus, taskset_prefix
from launch.launch_online_dp import main as launcher_main
from launch.processes import ProcessGroup, vllm_env

#: Prints "<own pid> <child pid>" (the child is forked after start-up, as vLLM forks EngineCore), then sleeps.
FORKER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    out = sys.argv[1] if len(sys.argv) > 1 else None
    line = f"{os.getpid()} {child.pid}\\n"
    if out:
        with open(out, "a") as f:
            f.write(line)
    else:
        print(line, end="", flush=True)
    time.sleep(600)
    """
)

CORES = sorted(os.sched_getaffinity(0))


def _pids(path: Path, lines: int = 1, timeout: float = 15.0) -> list[list[int]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        rows = [[int(x) for x in ln.split()] for ln in text.splitlines() if len(ln.split()) == 2]
        if len(rows) >= lines:
            return rows
        time.sleep(0.05)
    raise AssertionError(f"{path} did not get {lines} pid line(s): {path.read_text() if path.exists() else ''!r}")


def test_parse_and_format_core_lists() -> None:
    assert parse_cpus("0-1|2-3") == [0, 1, 2, 3]
    assert parse_cpus(" 3, 0-1 ") == [0, 1, 3]
    assert format_cpus([5, 0, 1, 2]) == "0-2,5"
    assert format_cpus(parse_cpus("0,2|4-5")) == "0,2,4-5"
    for bad in ("", "x", "3-1", "-1", "|"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_instance_cpus_comes_from_the_omp_binding_core_lists_only() -> None:
    assert instance_cpus({"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}) == "0-3"
    assert instance_cpus(vllm_env("1")) == "1"
    for value in ("", "auto", "all", "nobind"):
        assert instance_cpus({"VLLM_CPU_OMP_THREADS_BIND": value}) is None
    assert instance_cpus({}) is None
    assert instance_cpus(None) is None
    assert taskset_prefix("0-1") == ["taskset", "-c", "0-1"]
    assert taskset_prefix("") == []


@pytest.mark.parametrize("how", ["explicit", "vllm_env"])
def test_a_started_process_and_its_children_run_on_the_given_cores(tmp_path: Path, how: str) -> None:
    core = CORES[-1]
    kwargs = {"cpus": str(core)} if how == "explicit" else {"env": vllm_env(str(core))}
    with ProcessGroup(tmp_path) as group:
        proc = group.start("forker", [sys.executable, "-c", FORKER], **kwargs)
        assert proc.cpus == str(core)
        [(parent, child)] = _pids(proc.log_path)
        assert parent == proc.pid
        assert allowed_cpus(parent) == [core]
        assert allowed_cpus(child) == [core]


def test_empty_cpus_leaves_the_placement_alone(tmp_path: Path) -> None:
    with ProcessGroup(tmp_path) as group:
        proc = group.start("forker", [sys.executable, "-c", FORKER], env=vllm_env(str(CORES[0])), cpus="")
        [(parent, child)] = _pids(proc.log_path)
        assert allowed_cpus(parent) == CORES
        assert allowed_cpus(child) == CORES


@pytest.mark.skipif(len(CORES) < 2, reason="needs two CPUs")
def test_launcher_places_each_rank_tree_on_its_cpu_bind_share(tmp_path: Path) -> None:
    out = tmp_path / "pids"
    template = tmp_path / "t.sh"
    # $1 is the rank's devices (its OMP binding); the rank forks a child, both record their pids.
    template.write_text(
        f'echo "omp=$1" >&2\nexec {shlex.quote(sys.executable)} -c {shlex.quote(FORKER)} {shlex.quote(str(out))}\n'
    )
    argv = [
        "--dp-size", "2", "--dp-address", "127.0.0.1", "--vllm-start-port", "18600", "--host", "127.0.0.1",
        "--device", "cpu", "--cpu-bind", f"{CORES[0]};{CORES[1]}", "--template", str(template),
        "--no-health-watch", "--skip-port-check", "--log-dir", str(tmp_path / "logs"), "--stop-grace-s", "2",
    ]  # fmt: skip
    launcher = subprocess.Popen(
        [sys.executable, "-c", f"import sys; from launch.launch_online_dp import main; sys.exit(main({argv!r}))"],
        cwd=Path(__file__).resolve().parent.parent,
        start_new_session=True,
    )
    try:
        rows = _pids(out, lines=2)
        placed = sorted((allowed_cpus(parent), allowed_cpus(child)) for parent, child in rows)
        assert placed == [([CORES[0]], [CORES[0]]), ([CORES[1]], [CORES[1]])]
    finally:
        os.killpg(launcher.pid, 15)
        launcher.wait(timeout=30)


def test_dry_run_shows_the_taskset_placement(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--dp-size", "2", "--tp-size", "2", "--dp-address", "127.0.0.1", "--vllm-start-port", "18600",
        "--device", "cpu", "--cpu-bind", "0|1;2-3|4", "--model", "/m", "--dry-run",
    ]  # fmt: skip
    assert launcher_main(argv) == 0
    lines = [shlex.split(ln) for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    for words, cpus, omp in zip(lines, ("0-1", "2-4"), ("0|1", "2-3|4"), strict=True):
        i = words.index("taskset")
        assert words[i : i + 3] == ["taskset", "-c", cpus]
        assert words[i + 3 : i + 6] == ["bash", words[i + 4], omp]
