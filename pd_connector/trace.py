"""Phase traces of PD requests: one INFO summary line per request and side, and OpenTelemetry spans.

Each side records wall-clock times (``time.time()``, so P, D and the Router can be lined up)
of the phases it sees for one request, keyed by its bootstrap room:

- ``prefill`` (P's worker, TP rank 0): received (vLLM's arrival time), prefill_done (P's
  scheduler saw the request finish), d_asked (D's request reached P), push_started, push_done;
- ``decode`` (D's worker, TP rank 0): received (arrival time), admitted (D's scheduler
  allocated the blocks for the load), asked_p (the request went to every P rank), kv_ready
  (every P rank reported done), scheduled (D's scheduler scheduled the request after its KV
  arrived: its first token comes out of that step);
- ``router``: received, path_pd | path_delta | path_local (the path chosen), p_answered, d_first_byte, done.

The summary line, one per request and side (the ``TRACE_RE`` below parses it)::

    room=<room> req=<id> phase trace (<side>): t0=<epoch s> outcome=<outcome> <phase> +<ms> ms, ...

``t0`` is the first phase's wall-clock time (seconds since the epoch, 6 decimals); every phase
follows as its offset from t0 in milliseconds, in time order. ``outcome`` is ``ok``, or what
ended the request on that side (``expired``, ``failed:<reason>``, an HTTP status...).

With a tracer (``make_tracer``: vLLM started with ``--otlp-traces-endpoint``) the same trace
becomes a span ``pd.<side>`` (child of the request's ``traceparent`` when it had one) with one
child span per phase, from the previous phase to this one. This module imports no vLLM, so
the Router uses it too.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

PHASES: dict[str, tuple[str, ...]] = {
    "prefill": ("received", "prefill_done", "d_asked", "push_started", "push_done"),
    "decode": ("received", "admitted", "asked_p", "kv_ready", "scheduled"),
    "router": ("received", "path_pd", "path_delta", "path_local", "p_answered", "d_first_byte", "done"),
}

TRACE_RE = re.compile(
    r"room=(?P<room>\d+) req=(?P<req>\S+) phase trace \((?P<side>\w+)\): "
    r"t0=(?P<t0>\d+(?:\.\d+)?) outcome=(?P<outcome>\S+)(?: (?P<phases>.*))?$"
)
_PHASE_RE = re.compile(r"(?P<name>\w+) \+(?P<ms>-?\d+(?:\.\d+)?) ms")

#: Traces a side keeps open at most (requests that never finish are dropped oldest first).
MAX_OPEN_TRACES = 10_000


@dataclass
class PhaseTrace:
    """The phases one side saw for one request (wall-clock seconds)."""

    side: str
    room: int
    req_id: str = "?"
    phases: dict[str, float] = field(default_factory=dict)
    trace_headers: Mapping[str, str] | None = None
    outcome: str = "ok"

    def mark(self, phase: str, at: float | None = None) -> None:
        """Record ``phase`` now (or at ``at``); a later mark of the same phase wins."""
        self.phases[phase] = time.time() if at is None else at

    def mark_first(self, phase: str, at: float | None = None) -> None:
        """Record ``phase`` unless it is already recorded (e.g. the first of several pushes)."""
        if phase not in self.phases:
            self.mark(phase, at)

    def ordered(self) -> list[tuple[str, float]]:
        known = PHASES.get(self.side, ())
        rank = {name: i for i, name in enumerate(known)}
        return sorted(self.phases.items(), key=lambda kv: (kv[1], rank.get(kv[0], len(known))))

    def line(self) -> str:
        """The summary line (see the module docstring)."""
        items = self.ordered()
        t0 = items[0][1] if items else time.time()
        phases = ", ".join(f"{name} +{(t - t0) * 1e3:.1f} ms" for name, t in items)
        return (
            f"room={self.room} req={self.req_id} phase trace ({self.side}): t0={t0:.6f} outcome={self.outcome} {phases}"
        ).rstrip()


@dataclass(frozen=True)
class TraceRecord:
    """One parsed summary line."""

    side: str
    room: int
    req_id: str
    t0: float
    outcome: str
    phases: tuple[tuple[str, float], ...]  # (name, ms after t0), in line order

    def at(self, phase: str) -> float | None:
        """Wall-clock time of ``phase`` (None if the line does not have it)."""
        for name, ms in self.phases:
            if name == phase:
                return self.t0 + ms / 1e3
        return None


def parse_trace_line(line: str) -> TraceRecord | None:
    """The trace in a log line that contains a summary line (any prefix is skipped), else None."""
    m = TRACE_RE.search(line.rstrip())
    if m is None:
        return None
    phases = tuple((p["name"], float(p["ms"])) for p in _PHASE_RE.finditer(m["phases"] or ""))
    return TraceRecord(m["side"], int(m["room"]), m["req"], float(m["t0"]), m["outcome"], phases)


# ------------------------------------------------------------------------ OpenTelemetry


def make_tracer(otlp_traces_endpoint: str | None, service: str = "pd_connector") -> Any | None:
    """An OpenTelemetry tracer exporting to ``otlp_traces_endpoint`` (None: no endpoint or no SDK)."""
    if not otlp_traces_endpoint:
        return None
    try:
        import os

        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=otlp_traces_endpoint, insecure=True)
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]

            exporter = OTLPSpanExporter(endpoint=otlp_traces_endpoint)
    except ImportError as exc:
        logger.warning("OpenTelemetry SDK/exporter not installed (%s): phase traces only go to the log", exc)
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider.get_tracer("pd_connector.trace")


def _parent_context(headers: Mapping[str, str] | None) -> Any | None:
    if not headers:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(dict(headers))


def export_spans(tracer: Any, trace: PhaseTrace) -> None:
    """``pd.<side>`` from the first phase to the last, one child span per later phase."""
    from opentelemetry import trace as otel

    items = trace.ordered()
    if not items:
        return
    ns = [(name, int(t * 1e9)) for name, t in items]
    attrs = {"pd.room": str(trace.room), "pd.request_id": trace.req_id, "pd.outcome": trace.outcome}
    root = tracer.start_span(f"pd.{trace.side}", context=_parent_context(trace.trace_headers), start_time=ns[0][1])
    root.set_attributes(attrs)
    ctx = otel.set_span_in_context(root)
    for (_, prev), (name, t) in zip(ns, ns[1:], strict=False):
        child = tracer.start_span(f"pd.{trace.side}.{name}", context=ctx, start_time=prev)
        child.set_attributes(attrs)
        child.end(end_time=t)
    root.end(end_time=ns[-1][1])


class TraceBook:
    """Open traces of one side, keyed (room or request id); emits each once: log line + spans."""

    def __init__(self, side: str, tracer: Any | None = None, enabled: bool = True) -> None:
        self.side = side
        self.tracer = tracer
        self.enabled = enabled
        self._lock = threading.Lock()
        self._open: OrderedDict[Any, PhaseTrace] = OrderedDict()

    def get(self, key: Any, room: int, req_id: str | None = None) -> PhaseTrace:
        """The open trace of ``key`` (created if new); mutate it under no other lock than the caller's."""
        with self._lock:
            trace = self._open.get(key)
            if trace is None:
                trace = self._open[key] = PhaseTrace(self.side, room)
                while len(self._open) > MAX_OPEN_TRACES:
                    self._open.popitem(last=False)
            if req_id is not None:
                trace.req_id = req_id
            return trace

    def has(self, key: Any) -> bool:
        with self._lock:
            return key in self._open

    def emit(self, key: Any, outcome: str | None = None) -> None:
        """Close ``key``'s trace: log its summary line and export its spans (no-op if not open)."""
        with self._lock:
            trace = self._open.pop(key, None)
        if trace is None or not self.enabled:
            return
        if outcome is not None:
            trace.outcome = outcome
        logger.info("%s", trace.line())
        if self.tracer is not None:
            try:
                export_spans(self.tracer, trace)
            except Exception:  # noqa: BLE001 - tracing must never break a transfer
                logger.exception("room=%d req=%s: exporting phase spans failed", trace.room, trace.req_id)
