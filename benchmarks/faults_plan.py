"""The fault campaign's plan (benchmarks/faults.py): fault classes and the seeded request plans.

Every request is drawn from one ``random.Random(seed)`` before anything runs: its prompt (an entry of
a small pool whose colocated answers are computed first), whether it streams, and the fault that comes
with it. ``--seed`` replays the same plans; the timing of a live stack is not replayed.
"""

from __future__ import annotations

import enum
import random
from dataclasses import asdict, dataclass

from launch.fault_shim import FaultRates


class Fault(enum.Enum):
    """The fault a request comes with. Environment faults (kill, stop, shim, bootstrap, drain) act on
    the stack while the request is in flight, so the requests beside it see them too; client aborts
    act on that request alone."""

    NONE = "none"
    KILL_P = "kill_p"  # SIGKILL a P (its process group), restarted on the same ports
    KILL_D = "kill_d"
    STOP_P = "stop_p"  # SIGSTOP a P for a while, then SIGCONT
    STOP_D = "stop_d"
    ZMQ_DROP = "zmq_drop"  # the ZMTP proxies in front of P's ranks (launch.fault_shim)
    ZMQ_DUPLICATE = "zmq_duplicate"
    ZMQ_DELAY = "zmq_delay"
    ZMQ_REORDER = "zmq_reorder"
    ZMQ_TRUNCATE = "zmq_truncate"
    BOOTSTRAP_RST = "bootstrap_rst"  # the shims in front of P's bootstrap servers (launch.fault_shim_http)
    BOOTSTRAP_503 = "bootstrap_503"
    BOOTSTRAP_SLOW = "bootstrap_slow"
    BOOTSTRAP_RESTART = "bootstrap_restart"
    ABORT_BEFORE_ROUTING = "abort_before_routing"  # half a request body, then the connection closes
    ABORT_AFTER_P_ACCEPTED = "abort_after_p_accepted"  # the aborts below are aimed by timing
    ABORT_DURING_PUSH = "abort_during_push"
    ABORT_BEFORE_FIRST_TOKEN = "abort_before_first_token"
    ABORT_MID_STREAM = "abort_mid_stream"  # after a drawn number of events
    ABORT_DURING_RESUME = "abort_during_resume"  # its decoder drained (its stream moved), then the abort
    ABORT_DURING_DRAIN = "abort_during_drain"  # non-streamed, its decoder draining, then the abort
    ABORT_AFTER_DONE = "abort_after_done"  # the whole stream read, then a reset instead of a close

    @property
    def is_abort(self) -> bool:
        return self.value.startswith("abort_")

    @property
    def needs_stream(self) -> bool:
        return self in (Fault.ABORT_MID_STREAM, Fault.ABORT_DURING_RESUME, Fault.ABORT_AFTER_DONE)


ZMQ_RATES = {
    Fault.ZMQ_DROP: FaultRates(drop=0.3),
    Fault.ZMQ_DUPLICATE: FaultRates(duplicate=0.5),
    Fault.ZMQ_DELAY: FaultRates(delay=0.5, delay_s=0.3),
    Fault.ZMQ_REORDER: FaultRates(reorder=0.5, hold_s=0.3),
    Fault.ZMQ_TRUNCATE: FaultRates(truncate=0.3),
}

#: Tokens of the long answers the drain faults use (a few seconds of decoding here).
LONG_OUTPUT = 300
LONG_FAULTS = (Fault.ABORT_DURING_RESUME, Fault.ABORT_DURING_DRAIN)

#: Share of requests with no fault; the rest spread evenly over the fault classes.
NONE_SHARE = 0.15
#: Kills are costly here (a restart takes most of a minute on two cores): at most one in this many requests.
KILL_EVERY = 40
#: From this many requests on, kills may come anywhere in the run.
SPREAD_KILLS_FROM = 200


@dataclass(frozen=True)
class Prompt:
    """One entry of the prompt pool: ``prompt_of_length(length, salt)`` and its ``max_tokens``."""

    length: int
    salt: int
    max_tokens: int


@dataclass(frozen=True)
class RequestPlan:
    index: int
    prompt: Prompt
    stream: bool
    fault: Fault
    #: Fault parameters drawn with the plan: ``param`` is seconds (stop length, shim window, bootstrap
    #: down time) or, for the timed aborts, the abort time as a share of the prompt's measured time to
    #: first token; ``events`` is the event count of a mid-stream abort.
    param: float
    events: int
    #: Which instance of the role an environment fault acts on (0 or 1).
    target: int

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["fault"] = self.fault.value
        return out


def prompt_pool(rng: random.Random, size: int = 12) -> list[Prompt]:
    """``size`` prompts of mixed lengths (1..400 tokens: within a block, several blocks) and short outputs,
    and two with `LONG_OUTPUT` tokens: the streams a drain moves must still be running when it starts."""
    lengths = [1, 33, 129, 300, *[rng.randint(2, 400) for _ in range(max(0, size - 4))]][:size]
    short = [Prompt(n, rng.randint(0, 150), rng.choice((8, 16, 24, 32))) for n in lengths]
    return [*short, Prompt(40, rng.randint(0, 150), LONG_OUTPUT), Prompt(200, rng.randint(0, 150), LONG_OUTPUT)]


def draw_plans(rng: random.Random, pool: list[Prompt], n: int, *, every_class: bool) -> list[RequestPlan]:
    """``n`` plans; with ``every_class`` each fault class comes at least once (n must allow it)."""
    classes = [f for f in Fault if f is not Fault.NONE]
    kills = (Fault.KILL_P, Fault.KILL_D)
    faults: list[Fault] = []
    if every_class:
        if n < len(Fault):
            raise ValueError(f"--requests {n} is too few for every fault class ({len(Fault)} classes)")
        faults = list(Fault)
    while len(faults) < n:
        if rng.random() < NONE_SHARE:
            faults.append(Fault.NONE)
            continue
        fault = rng.choice(classes)
        if fault in kills and sum(f in kills for f in faults) * KILL_EVERY >= n:
            fault = Fault.NONE
        faults.append(fault)
    rng.shuffle(faults)
    # short runs: kills in the last quarter (a restart takes most of a minute here, and while one runs
    # no drain is set off); long runs spread them
    late = [i for i in range(n * 3 // 4, n) if faults[i] not in kills] if n < SPREAD_KILLS_FROM else []
    rng.shuffle(late)
    for i in [i for i in range(n * 3 // 4) if faults[i] in kills]:
        if late:
            j = late.pop()
            faults[i], faults[j] = faults[j], faults[i]
    # the first requests run on a quiet stack (they measure the prompts' times to first token)
    quiet = [i for i, f in enumerate(faults) if f is Fault.NONE][:2]
    for j, i in enumerate(quiet):
        faults[j], faults[i] = faults[i], faults[j]
    return [_plan(rng, i, pool, f) for i, f in enumerate(faults)]


def _plan(rng: random.Random, index: int, pool: list[Prompt], fault: Fault) -> RequestPlan:
    long = fault in LONG_FAULTS
    prompt = rng.choice([p for p in pool if (p.max_tokens == LONG_OUTPUT) == long])
    stream = True if fault.needs_stream else (False if fault is Fault.ABORT_DURING_DRAIN else rng.random() < 0.5)
    if fault in (Fault.STOP_P, Fault.STOP_D):
        param = rng.uniform(1.0, 5.0)  # stopped seconds: shorter and longer than the peer timeout
    elif fault is Fault.ABORT_AFTER_P_ACCEPTED:
        param = rng.uniform(0.1, 0.5)
    elif fault is Fault.ABORT_DURING_PUSH:
        param = rng.uniform(0.6, 0.95)
    elif fault is Fault.ABORT_BEFORE_FIRST_TOKEN:
        param = rng.uniform(0.9, 1.1)
    else:
        param = rng.uniform(0.5, 2.0)  # window of a shim or bootstrap fault; restart: seconds down
    events = rng.randint(1, max(1, prompt.max_tokens // 2))
    return RequestPlan(index, prompt, stream, fault, round(param, 3), events, rng.randrange(2))
