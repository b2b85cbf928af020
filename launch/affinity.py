"""CPU placement of a whole vLLM instance: every process of its tree on the instance's cores.

vLLM's CPU workers spin for about a second after each engine message. With only the OpenMP
threads bound (`VLLM_CPU_OMP_THREADS_BIND`), the API server, the EngineCore process and the
workers' other threads float over every core, so one instance's spinning workers starve the
other instance's API server and engine. A process started with an affinity mask passes it on to
every child it forks, so pinning the `vllm serve` process itself (what `taskset -c CORES vllm
serve ...` does) places the whole instance. `ProcessGroup.start(cpus=...)` does that with
`os.sched_setaffinity` in the child before it runs the command.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from launch.dp_checks import UsageError, parse_id_list

#: vLLM's OpenMP binding of a CPU instance: core lists, one per TP rank, joined by '|'.
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
#: Values of VLLM_CPU_OMP_THREADS_BIND that are not core lists.
OMP_BIND_KEYWORDS = frozenset({"", "auto", "all", "nobind"})


def parse_cpus(spec: str) -> list[int]:
    """'0-1|2-3', '0,2', '3' -> the sorted cores (TP groups joined by '|' are merged); ValueError if none."""
    cores: set[int] = set()
    try:
        for group in spec.split("|"):
            cores.update(parse_id_list(group, "core list"))
    except UsageError as exc:
        raise ValueError(f"not a core list: {spec!r} ({exc})") from None
    if not cores:
        raise ValueError(f"no cores in {spec!r}")
    return sorted(cores)


def format_cpus(cores: Collection[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (what `taskset -c` and Cpus_allowed_list show)."""
    ids = sorted(cores)
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def instance_cpus(env: Mapping[str, str] | None) -> str | None:
    """The cores a process started with `env` belongs on: its VLLM_CPU_OMP_THREADS_BIND as one list.

    None when `env` has no core list there (no env given, unset, or one of vLLM's keywords).
    """
    if env is None:
        return None
    spec = env.get(OMP_BIND_ENV, "").strip()
    if spec in OMP_BIND_KEYWORDS:
        return None
    return format_cpus(parse_cpus(spec))


def pin_to(cpus: str) -> Callable[[], None]:
    """A `preexec_fn` that puts the (forked, not yet exec'd) child on `cpus` ('0-1,3' form).

    The cores are parsed here, in the parent, so the child only makes one system call.
    """
    cores = set(parse_cpus(cpus))

    def pin() -> None:
        os.sched_setaffinity(0, cores)

    return pin


def taskset_prefix(cpus: str | None) -> list[str]:
    """`taskset -c CPUS` for a shell line that places a command as `pin_to(cpus)` does ([] for None/'')."""
    return ["taskset", "-c", cpus] if cpus else []


def allowed_cpus(pid: int) -> list[int]:
    """The cores process `pid` may run on, from /proc/PID/status (Cpus_allowed_list)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpus(line.split(":", 1)[1])
    raise ValueError(f"no Cpus_allowed_list in /proc/{pid}/status")
