"""The fault campaign's injector (benchmarks/faults.py): one planned request with its fault set off.

Environment faults (kill, stop, ZMQ shim, bootstrap shim, drain) take ``Stack.lock`` for their window,
so at most one is active at a time; the requests running beside it see it too. A kill restarts the
instance in the background (the lock is not held meanwhile) and is skipped while its role has an
instance down; a drain is skipped while any instance is down (it would leave no decoder).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from benchmarks.faults_checks import RequestRecord
from benchmarks.faults_client import Call, Outcome, abort_before_routing, body_of, call
from benchmarks.faults_plan import ZMQ_RATES, Fault, RequestPlan
from benchmarks.faults_stack import CLIENT_DEADLINE_S, Instance, Stack
from launch.fault_shim import NO_FAULTS
from launch.fault_shim_http import BootstrapMode
from launch.ports import LOOPBACK

logger = logging.getLogger("faults")

BOOTSTRAP_MODES = {
    Fault.BOOTSTRAP_RST: BootstrapMode.REFUSE_RST,
    Fault.BOOTSTRAP_503: BootstrapMode.REFUSE_503,
    Fault.BOOTSTRAP_SLOW: BootstrapMode.SLOW,
}
DRAIN_TIMEOUT_S = 20.0


class Injector:
    def __init__(self, stack: Stack, prompts: dict[tuple[int, int], str], ttft: dict[tuple[int, int], float]) -> None:
        self.stack = stack
        self.prompts = prompts
        self.ttft = ttft
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="faults-env")

    def run(self, plan: RequestPlan, rid: str) -> RequestRecord:
        key = (plan.prompt.length, plan.prompt.salt)
        body = body_of(self.stack.model, plan, self.prompts[key])
        ttft = self.ttft.get(key, 0.3)
        url = self.stack.router_url
        fault = plan.fault
        record = RequestRecord(plan, Call(Outcome.UNCLEAR))

        def send(**kw: object) -> Call:
            return call(url, body, deadline_s=CLIENT_DEADLINE_S, rid=rid, **kw)  # type: ignore[arg-type]

        if fault is Fault.NONE:
            record.call = send()
        elif fault is Fault.ABORT_BEFORE_ROUTING:
            record.call = abort_before_routing(url, body)
        elif fault in (Fault.ABORT_AFTER_P_ACCEPTED, Fault.ABORT_DURING_PUSH, Fault.ABORT_BEFORE_FIRST_TOKEN):
            record.call = send(abort_after_s=plan.param * ttft)
            record.note = f"aborted at {plan.param * ttft:.3f} s (time to first token measured {ttft:.3f} s)"
        elif fault is Fault.ABORT_MID_STREAM:
            record.call = send(abort_after_events=plan.events)
        elif fault is Fault.ABORT_AFTER_DONE:
            record.call = send(reset_after_done=True)
        elif fault in (Fault.ABORT_DURING_RESUME, Fault.ABORT_DURING_DRAIN):
            with self.stack.lock:  # held until the decoder is back in routing
                record.call = self._with_drain(plan, record, send, ttft, rid)
        else:
            with self.stack.lock:
                record.call = self._with_env_fault(plan, record, send, rid)
        return record

    # -- environment faults ------------------------------------------------------------------
    def _target(self, role: str, rid: str, fallback: int) -> Instance:
        """The instance of ``role`` serving ``rid`` (found in D's log), else a busy one."""
        decode, prefill = self.stack.locate(rid)
        found = decode if role == "decode" else prefill
        return found if found is not None else self.stack.busy(role, fallback)

    def _with_env_fault(self, plan: RequestPlan, record: RequestRecord, send: Callable[..., Call], rid: str) -> Call:
        fault, stack = plan.fault, self.stack
        future: Future[Call] = self._pool.submit(send)
        t0 = time.monotonic()
        if fault in (Fault.KILL_P, Fault.KILL_D):
            time.sleep(0.1 * plan.param)
            inst = self._target("prefill" if fault is Fault.KILL_P else "decode", rid, plan.target)
            record.applied = stack.kill(inst)
            record.note = f"SIGKILL {inst.name}" if record.applied else f"{inst.name}'s role has an instance down"
        elif fault in (Fault.STOP_P, Fault.STOP_D):
            inst = self._target("prefill" if fault is Fault.STOP_P else "decode", rid, plan.target)
            record.applied = stack.freeze(inst, plan.param)
            record.note = f"SIGSTOP {inst.name} for {plan.param:.1f} s" if record.applied else f"{inst.name} is down"
        elif fault in ZMQ_RATES:
            before = _zmq_counts(stack)
            for shim in stack.shims:
                shim.set_zmq_rates(ZMQ_RATES[fault])
            _wait(t0 + plan.param)
            for shim in stack.shims:
                shim.set_zmq_rates(NO_FAULTS)
            hit = _zmq_counts(stack) - before
            record.note = f"ZMTP proxies for {time.monotonic() - t0:.1f} s: {dict(hit)}"
        elif fault in BOOTSTRAP_MODES:
            before = _boot_counts(stack)
            for shim in stack.shims:
                shim.set_mode(BOOTSTRAP_MODES[fault], slow_s=plan.param)
            _wait(t0 + plan.param)
            for shim in stack.shims:
                shim.set_mode(BootstrapMode.PASS)
            record.note = f"bootstrap shims {BOOTSTRAP_MODES[fault].value}: {_boot_counts(stack) - before} call(s) hit"
        elif fault is Fault.BOOTSTRAP_RESTART:
            shim = stack.of_role("prefill")[plan.target].shim
            assert shim is not None
            shim.restart(plan.param)
            record.note = f"bootstrap shim :{shim.port} down for {plan.param:.1f} s"
        return future.result()

    # -- drains ------------------------------------------------------------------------------
    def _drain(self, inst: Instance) -> str:
        """Drain ``inst`` (a decoder) through the Router's admin API, then add it back."""
        where = {"role": "decode", "host": LOOPBACK, "port": inst.port}
        try:
            resp = self.stack.admin("/instances/drain", {**where, "timeout_s": DRAIN_TIMEOUT_S}, DRAIN_TIMEOUT_S + 5)
            result = f"drain {inst.name}: HTTP {resp.status_code} {resp.text[:200]}"
        except Exception as exc:  # the report says what happened; the instance is added back regardless
            result = f"drain {inst.name}: {type(exc).__name__}: {exc}"
        finally:
            self.stack.admin("/instances/add", where, 10)
        logger.info("%s", result)
        return result

    def _with_drain(
        self, plan: RequestPlan, record: RequestRecord, send: Callable[..., Call], ttft: float, rid: str
    ) -> Call:
        """The request; once its decoder has it (a first event, or D's log line), that decoder is drained
        (under ``Stack.lock``, held by the caller) and the client leaves while the drain runs: a stream
        while the Router moves it to the other decoder, a non-streamed answer while it finishes in place."""
        drains: list[threading.Thread] = []

        def start() -> None:
            if self.stack.any_down():
                record.applied, record.note = False, "an instance is down: no drain"
                return
            inst = self._target("decode", rid, plan.target)

            def drain() -> None:
                record.note = self._drain(inst)

            drains.append(threading.Thread(target=drain, name=f"drain-{plan.index}", daemon=True))
            drains[-1].start()

        if plan.fault is Fault.ABORT_DURING_RESUME:

            def on_event(n: int) -> float | None:
                if n != 1:
                    return None
                start()
                return 0.05 + 0.1 * plan.param

            result = send(on_event=on_event)
        else:
            threading.Thread(target=start, daemon=True).start()
            result = send(abort_after_s=ttft + 0.3 + 0.25 * plan.param)
        if drains:
            drains[0].join(DRAIN_TIMEOUT_S + 20)
        elif record.applied:
            record.applied, record.note = False, record.note or "the request ended before its decoder was found"
        return result


def _wait(until: float) -> None:
    """Until ``until`` (the fault window's end: its length is drawn, whether the request ended or not)."""
    rest = until - time.monotonic()
    if rest > 0:
        time.sleep(rest)


def _zmq_counts(stack: Stack) -> Counter[str]:
    total: Counter[str] = Counter()
    for shim in stack.shims:
        total.update(shim.zmq_counts())
    return total


def _boot_counts(stack: Stack) -> int:
    return sum(sum(v for k, v in shim.counts.items() if k != "pass" and k != "restarts") for shim in stack.shims)


def jitter(rng: random.Random) -> float:
    """Seconds between two request starts (the plans come in a steady, slightly uneven stream)."""
    return rng.uniform(0.0, 0.15)
