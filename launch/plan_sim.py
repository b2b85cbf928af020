"""Discrete-event simulator of P, D and colocated (C) vLLM instances for ``python -m launch.plan``.

Each instance runs engine steps the way vLLM V1's scheduler composes them: the running
requests' decode tokens first, then chunks of waiting prompts (FCFS, chunked prefill) in the
rest of the token budget (``budget`` = ``--max-num-batched-tokens``), at most ``max_num_seqs``
requests at once. A step's time comes from the instance's ``StepModel`` (the Router's model,
``proxy.planning.step_model``); a KV push's from the ``TransferModel``.

- P only prefills. When a prompt is done, P's first token is the request's first token (the
  first-token path) and the KV is pushed; when the push ends the request joins D's batch. P's
  next step waits ``TransferModel.sender_ms`` of the pushes (its cores copying the KV out).
- D decodes; a request on the LOCAL path prefills on D, beside D's running decodes.
- C (colocated) prefills and decodes every request it gets; colocated instances take requests in turn
  (round robin, as a plain load balancer does).

Each instance has an LRU prefix cache of trace prefixes (``prefix_id``): a prefix is cached on
an instance once it prefilled it or received its KV. A request reaches its instance's queue
``Models.overhead_ms`` after the routing decision (front end, HTTP, API server). Not modelled:
KV memory limits and preemption, push contention between requests, the Router's own latency.

Speed: a run of decode-only steps with a fixed batch is one event (its end is computed in
closed form); an arrival that brings work cuts it at the end of the step in progress.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from launch.plan_trace import TraceRequest
from proxy.planning.duty import PrefillDuty
from proxy.planning.path_policy import PATH_POLICIES, PathOptions
from proxy.planning.predict import DecoderLoad, PairState, Path, PathModel, PrefillerLoad, RequestView
from proxy.planning.step_model import StepModel, TransferModel


class Role(enum.Enum):
    P = "P"
    D = "D"
    C = "C"


class Policy(enum.Enum):
    ALWAYS_PD = "always-pd"
    ALWAYS_LOCAL = "always-local"
    THRESHOLD = "threshold"  # NVIDIA Dynamo's conditional disaggregation
    NON_CACHED = "non-cached"  # llm-d's prefix-based PD decider
    ADAPTIVE = "adaptive"  # lowest predicted TTFT within the TPOT SLO (proxy.planning)


class _Event(enum.IntEnum):
    ARRIVAL = 0
    STEP_END = 1
    PUSH_DONE = 2
    ADMIT = 3


@dataclass
class InstanceConfig:
    budget: int = 2048
    max_num_seqs: int = 128
    prefix_cache_entries: int = 64


@dataclass
class PolicyConfig:
    threshold_tokens: int = 2048  # Dynamo: local when uncached < this ...
    threshold_ratio: float = 0.7  # ... and uncached / prompt < this
    non_cached_tokens: int = 512  # llm-d: disaggregate when non-cached tokens exceed this
    tpot_slo_ms: float = 50.0  # adaptive: paths predicted over this TPOT are ruled out
    local_margin: float = 0.1  # adaptive: D prefills only when it beats P's TTFT by this fraction


@dataclass
class Models:
    p: StepModel = field(default_factory=StepModel)
    d: StepModel = field(default_factory=StepModel)
    c: StepModel = field(default_factory=StepModel)
    transfer: TransferModel = field(default_factory=TransferModel)
    #: A request's time outside the engines, in ms: the front end, HTTP, the API server's input and
    #: output processing. The simulator spends it between the routing decision and the instance's queue
    #: (in a closed loop, where it sits between one first token and the next admission does not matter).
    overhead_ms: float = 0.0

    def of(self, role: Role) -> StepModel:
        return {Role.P: self.p, Role.D: self.d, Role.C: self.c}[role]


class Req:
    __slots__ = ("t", "arrival", "prompt", "output", "prefix_id", "prefix_tokens", "path", "d", "pushed")
    __slots__ += ("cached", "left", "first_t", "finish_t")

    def __init__(self, t: TraceRequest) -> None:
        self.t = t
        self.arrival, self.prompt, self.output = t.arrival_s * 1e3, t.prompt_tokens, t.output_tokens
        self.prefix_id, self.prefix_tokens = t.prefix_id, t.prefix_tokens
        self.path = Path.LOCAL
        self.d: Instance | None = None
        self.pushed = 0
        self.cached = -1  # tokens served from the prefilling instance's cache; -1 until its first chunk
        self.left = 0  # prompt tokens still to compute
        self.first_t = math.nan
        self.finish_t = math.nan


class Instance:
    def __init__(self, sim: Simulator, role: Role, index: int, model: StepModel, cfg: InstanceConfig) -> None:
        self.sim, self.role, self.name, self.model, self.cfg = sim, role, f"{role.value}{index}", model, cfg
        self.waiting: deque[Req] = deque()
        self.joins: deque[Req] = deque()
        self.running: list[tuple[int, int, Req]] = []  # (finish step, seq, request)
        self.steps = 0
        self.ctx = 0  # context tokens held by the running batch
        self.queued_tokens = 0
        self.cache: OrderedDict[str, None] = OrderedDict()
        self.version = 0
        self.busy = False
        self.run: tuple[float, int, float, float] = (0.0, 0, 0.0, 0.0)  # start, k, first step ms, growth
        self.chunks: list[tuple[Req, int]] = []
        self.duty = PrefillDuty()  # D: the local prefills sent to it lately, as the Router records them

    def cached_tokens(self, r: Req) -> int:
        return r.prefix_tokens if r.prefix_id is not None and r.prefix_id in self.cache else 0

    def remember(self, r: Req) -> None:
        if r.prefix_id is None:
            return
        self.cache[r.prefix_id] = None
        self.cache.move_to_end(r.prefix_id)
        while len(self.cache) > self.cfg.prefix_cache_entries:
            self.cache.popitem(last=False)

    def load(self) -> int:
        return len(self.running) + len(self.joins) + len(self.waiting)

    def enqueue_prefill(self, r: Req, now: float) -> None:
        r.left = r.prompt
        self.waiting.append(r)
        self.queued_tokens += r.prompt
        self.poke(now)

    def enqueue_join(self, r: Req, now: float) -> None:
        self.joins.append(r)
        self.poke(now)

    # --- steps --------------------------------------------------------------------------
    def poke(self, now: float) -> None:
        """New work: start a step when idle; cut a decode-only run at the step in progress."""
        if not self.busy:
            self.start(now)
            return
        start, k, s0, g = self.run
        if k <= 1:
            return
        done = _steps_within(now - start, s0, g)
        if done + 1 < k:
            self._schedule(start, done + 1, s0, g)

    def _schedule(self, start: float, k: int, s0: float, g: float) -> None:
        self.version += 1
        self.run = (start, k, s0, g)
        self.sim.push(start + k * s0 + g * k * (k - 1) / 2.0, _Event.STEP_END, self, self.version)

    def start(self, now: float) -> None:
        cap = self.cfg.max_num_seqs
        while self.joins and len(self.running) < cap:
            r = self.joins.popleft()
            self.remember(r)
            self._add_running(r, r.output - 1)
        batch = len(self.running)
        room = self.cfg.budget - batch
        self.chunks = []
        tokens, attn = 0, 0.0
        for r in self.waiting:
            if room <= 0 or batch + len(self.chunks) >= cap:
                break
            if r.cached < 0:
                r.cached = min(self.cached_tokens(r), r.prompt - 1)
                self.queued_tokens -= r.cached
                r.left = r.prompt - r.cached
            chunk = min(r.left, room)
            self.chunks.append((r, chunk))
            tokens += chunk
            attn += chunk * (r.prompt - r.left + chunk)
            room -= chunk
        if tokens:
            self.busy = True
            self._schedule(now, 1, self.model.step_ms(tokens, attn, batch, self.ctx), 0.0)
        elif batch:
            self.busy = True
            k = self.running[0][0] - self.steps
            self._schedule(now, k, self.model.decode_step_ms(batch, self.ctx), self.model.f * batch)
        else:
            self.busy = False

    def _add_running(self, r: Req, remaining: int) -> None:
        self.ctx += r.prompt + 1
        heapq.heappush(self.running, (self.steps + remaining, id(r), r))

    def step_end(self, now: float, version: int) -> None:
        if version != self.version:
            return
        _, k, _, _ = self.run
        self.ctx += len(self.running) * k
        self.steps += k
        for r, chunk in self.chunks:
            r.left -= chunk
            self.queued_tokens -= chunk
        self.chunks = []
        sending = 0.0
        while self.waiting and self.waiting[0].left == 0:
            r = self.waiting.popleft()
            self._prefilled(r, now)
            if self.role is Role.P and r.output > 1:
                sending += self.sim.models.transfer.sender_ms(r.pushed)
        while self.running and self.running[0][0] <= self.steps:
            _, _, r = heapq.heappop(self.running)
            self.ctx -= r.prompt + r.output
            self.sim.finish(r, now)
        if sending > 0:  # P's cores put the KV on the wire before its next step (a step of no tokens)
            self._schedule(now, 1, sending, 0.0)
            return
        self.start(now)

    def _prefilled(self, r: Req, now: float) -> None:
        r.first_t = now
        self.sim.first_token(now)
        self.remember(r)
        if r.output == 1:
            self.sim.finish(r, now)
        elif self.role is Role.P:
            self.sim.push(now + self.sim.models.transfer.push_ms(r.pushed), _Event.PUSH_DONE, r, 0)
        else:
            self._add_running(r, r.output - 1)


def _steps_within(elapsed: float, s0: float, g: float) -> int:
    """Whole steps of a run (step j lasts s0 + g*j) that end by ``elapsed``."""
    if elapsed <= 0 or s0 <= 0:
        return 0
    if g <= 0:
        return int(elapsed // s0)
    half = g / 2.0
    return max(0, int((-(s0 - half) + math.sqrt((s0 - half) ** 2 + 4 * half * elapsed)) / (2 * half)))


@dataclass
class RunResult:
    ttft_ms: list[float]
    tpot_ms: list[float]
    good: int
    span_s: float
    paths: dict[str, int]


class Simulator:
    """One topology (``p`` P and ``d`` D instances, or ``c`` colocated ones) under one policy."""

    def __init__(
        self,
        *,
        p: int = 0,
        d: int = 0,
        c: int = 0,
        policy: Policy = Policy.ALWAYS_PD,
        models: Models | None = None,
        instance: InstanceConfig | None = None,
        policy_cfg: PolicyConfig | None = None,
    ) -> None:
        if c and (p or d) or not c and not (p and d):
            raise ValueError(f"topology p={p} d={d} c={c}: give p>=1 and d>=1, or c>=1 alone")
        self.models = models or Models()
        cfg = instance or InstanceConfig()
        self.policy, self.pcfg = policy, policy_cfg or PolicyConfig()
        pcfg = self.pcfg
        self.options = PathOptions(
            threshold_tokens=pcfg.threshold_tokens,
            threshold_ratio=pcfg.threshold_ratio,
            non_cached_tokens=pcfg.non_cached_tokens,
            tpot_slo_ms=pcfg.tpot_slo_ms,
            local_margin=pcfg.local_margin,
        )
        self.ps = [Instance(self, Role.P, i, self.models.p, cfg) for i in range(p)]
        self.ds = [Instance(self, Role.D, i, self.models.d, cfg) for i in range(d)]
        self.cs = [Instance(self, Role.C, i, self.models.c, cfg) for i in range(c)]
        self.path_model = PathModel(self.models.p, self.models.d, self.models.transfer)
        self.events: list[tuple[float, int, int, object, int]] = []
        self.seq = 0
        self.done: list[Req] = []
        self.pending: deque[TraceRequest] = deque()
        self.paths: dict[str, int] = {}
        self.rr = 0

    def push(self, t: float, kind: _Event, obj: object, version: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj, version))

    def finish(self, r: Req, now: float) -> None:
        r.finish_t = now
        self.done.append(r)

    def first_token(self, now: float) -> None:
        """Closed loop: a first token lets the next request of the trace in."""
        if self.pending:
            r = Req(self.pending.popleft())
            r.arrival = now
            self.push(now, _Event.ARRIVAL, r, 0)

    def run(
        self, trace: Sequence[TraceRequest], slo_ttft_ms: float, slo_tpot_ms: float, closed_loop: int = 0
    ) -> RunResult:
        """Replay ``trace``; with ``closed_loop`` N, arrival times are ignored: N requests start at 0
        and each next one arrives when a request's first token does (the closed-loop benchmark's
        load, ``benchmarks/serving_closed.py``)."""
        self.pending = deque(trace[closed_loop:] if closed_loop > 0 else ())
        for t in trace[:closed_loop] if closed_loop > 0 else trace:
            r = Req(t)
            if closed_loop > 0:
                r.arrival = 0.0
            self.push(r.arrival, _Event.ARRIVAL, r, 0)
        events = self.events
        while events:
            now, _, kind, obj, version = heapq.heappop(events)
            if kind is _Event.STEP_END:
                obj.step_end(now, version)  # type: ignore[attr-defined]
            elif kind is _Event.ARRIVAL:
                self.route(obj, now)  # type: ignore[arg-type]
            elif kind is _Event.ADMIT:
                inst, req = obj  # type: ignore[misc]
                inst.queued_tokens -= req.prompt  # counted from the decision on (_admit); the queue counts it now
                inst.enqueue_prefill(req, now)
            else:
                r: Req = obj  # type: ignore[assignment]
                assert r.d is not None
                r.d.enqueue_join(r, now)
        ttft = [r.first_t - r.arrival for r in self.done]
        tpot = [(r.finish_t - r.first_t) / (r.output - 1) for r in self.done if r.output > 1]
        good = sum(
            1
            for r in self.done
            if r.first_t - r.arrival <= slo_ttft_ms
            and (r.output == 1 or (r.finish_t - r.first_t) / (r.output - 1) <= slo_tpot_ms)
        )
        first = min((r.arrival for r in self.done), default=0.0)
        last = max((r.finish_t for r in self.done), default=0.0)
        return RunResult(ttft, tpot, good, max(1e-9, (last - first) / 1e3), dict(self.paths))

    # --- routing ------------------------------------------------------------------------
    def route(self, r: Req, now: float) -> None:
        if self.cs:
            # round robin, as a plain load balancer in front of colocated instances (and the benchmarks') does
            c = self.cs[self.rr % len(self.cs)]
            self.rr += 1
            self._count(Path.LOCAL)
            self._admit(c, r, now)
            return
        d = min(self.ds, key=lambda i: (i.load(), -i.cached_tokens(r)))
        p = min(self.ps, key=lambda i: self._p_ms(i, r))
        r.path = self.choose(r, p, d, now)
        self._count(r.path)
        if r.path is Path.LOCAL:
            cached = min(d.cached_tokens(r), r.prompt - 1)
            d.duty.add(now, d.model.prefill_ms(r.prompt - cached, cached))
            self._admit(d, r, now)
            return
        r.d = d
        r.pushed = r.prompt if r.path is Path.PD else r.prompt - min(d.cached_tokens(r), r.prompt - 1)
        self._admit(p, r, now)

    def _admit(self, inst: Instance, r: Req, now: float) -> None:
        """``r`` joins ``inst``'s queue once its time outside the engines (``Models.overhead_ms``) is spent."""
        if self.models.overhead_ms > 0:
            inst.queued_tokens += r.prompt  # the next decisions see it on its way
            self.push(now + self.models.overhead_ms, _Event.ADMIT, (inst, r), 0)
        else:
            inst.enqueue_prefill(r, now)

    def _count(self, path: Path) -> None:
        self.paths[path.value] = self.paths.get(path.value, 0) + 1

    def _p_ms(self, inst: Instance, r: Req) -> float:
        cached = min(inst.cached_tokens(r), r.prompt - 1)
        m, budget = inst.model, inst.cfg.budget
        return m.drain_ms(inst.queued_tokens, budget) + m.chunked_prefill_ms(r.prompt - cached, cached, budget)

    def choose(self, r: Req, p: Instance, d: Instance, now: float) -> Path:
        """The path the Router's policy (``proxy.planning.path_policy``, the same table) picks for ``r``."""
        cached_d = min(d.cached_tokens(r), r.prompt - 1)
        cached_p = min(p.cached_tokens(r), r.prompt - 1)
        state = PairState(
            RequestView(r.prompt, cached_p, cached_d, max(1, r.output - 1)),
            PrefillerLoad(p.queued_tokens, 0, p.cfg.budget),
            _decoder_load(d, now),
        )
        return PATH_POLICIES[self.policy.value](state, self.options, self.path_model).path


def _decoder_load(inst: Instance, now: float) -> DecoderLoad:
    running = len(inst.running) + len(inst.joins)
    return DecoderLoad(running, inst.ctx, inst.queued_tokens, None, inst.cfg.budget, inst.duty.recent_ms(now))
