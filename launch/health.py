"""Wait for managed processes to answer HTTP health checks.

- `wait_all_healthy` / `wait_http_ok`: block until every URL answered 200 once; raise
  `ProcessFailed` when a process exits first or time runs out.
- `watch_health`: no deadline, nothing raised; report each URL as it turns healthy and drop the
  ones whose process exited (for a background thread beside a `ProcessGroup.wait`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import httpx

from launch.process_group import ManagedProcess, ProcessFailed

#: vLLM instances on this machine start in ~30-60 s each; leave room for a slow, loaded box.
DEFAULT_START_TIMEOUT_S = 300.0


def _probe(client: httpx.Client, url: str) -> str | None:
    """GET `url`: None when it answered 200, else what went wrong (one line)."""
    try:
        resp = client.get(url)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if resp.status_code == 200 else f"HTTP {resp.status_code}"


def wait_all_healthy(
    targets: Sequence[tuple[str, ManagedProcess | None]],
    timeout: float = DEFAULT_START_TIMEOUT_S,
    *,
    watch: Sequence[ManagedProcess] = (),
    interval: float = 0.5,
) -> None:
    """Poll every (url, process) target with GET until each has answered 200 once.

    Raises `ProcessFailed` as soon as a target's process, or one of `watch`, exits (with the
    tail of its log), or when `timeout` seconds pass with a target still not ready.
    """
    deadline = time.monotonic() + timeout
    pending = list(targets)
    last_error: dict[str, str] = {}
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            for proc in [p for _, p in pending if p is not None] + list(watch):
                if not proc.is_running():
                    waiting_for = ", ".join(url for url, _ in pending)
                    reason = f"exited with code {proc.poll()} while waiting for {waiting_for}"
                    raise ProcessFailed(proc.describe_failure(reason))
            for url, proc in list(pending):
                error = _probe(client, url)
                if error is None:
                    pending.remove((url, proc))
                else:
                    last_error[url] = error
            if not pending:
                return
            if time.monotonic() >= deadline:
                url, proc = pending[0]
                reason = f"not ready at {url} after {timeout:.0f} s ({last_error.get(url, 'no answer')})"
                raise ProcessFailed(proc.describe_failure(reason) if proc is not None else reason)
            time.sleep(interval)


def wait_http_ok(
    url: str,
    timeout: float = DEFAULT_START_TIMEOUT_S,
    proc: ManagedProcess | None = None,
    interval: float = 0.5,
) -> None:
    """Poll `url` with GET until it answers 200.

    Raises `ProcessFailed` (with the tail of the process's log when `proc` is given) if `proc`
    exits first or if `timeout` seconds pass.
    """
    wait_all_healthy([(url, proc)], timeout, interval=interval)


def watch_health(
    targets: Sequence[tuple[str, ManagedProcess]],
    on_healthy: Callable[[int], None],
    *,
    interval: float = 1.0,
    request_timeout: float = 2.0,
) -> None:
    """Poll every (url, process) target until it answers 200 or its process exits.

    Calls `on_healthy(i)` once for target i when it first answers 200; a target whose process
    exited is dropped silently. Returns when no target is left.
    """
    pending = list(enumerate(targets))
    with httpx.Client(timeout=request_timeout, trust_env=False) as client:
        while pending:
            for item in list(pending):
                i, (url, proc) = item
                if not proc.is_running():
                    pending.remove(item)
                elif _probe(client, url) is None:
                    pending.remove(item)
                    on_healthy(i)
            if pending:
                time.sleep(interval)
