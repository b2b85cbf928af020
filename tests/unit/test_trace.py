"""Phase traces: the summary line's format and parser, OpenTelemetry spans (in-memory exporter),
and the traces and stats of a real P -> D transfer between two in-process managers."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from pd_connector.metadata import SendJob
from pd_connector.trace import PHASES, PhaseTrace, TraceBook, export_spans, parse_trace_line
from tests.support import transfer_rig as tm


def test_line_format_round_trips() -> None:
    trace = PhaseTrace("decode", 42, "cmpl-1")
    for i, phase in enumerate(PHASES["decode"]):
        trace.mark(phase, 1000.0 + i * 0.0125)
    line = trace.line()
    assert line.startswith("room=42 req=cmpl-1 phase trace (decode): t0=1000.000000 outcome=ok received +0.0 ms, ")
    rec = parse_trace_line("INFO 12-01 08:00:00 [pd_connector.trace] " + line)
    assert rec is not None and (rec.side, rec.room, rec.req_id, rec.outcome) == ("decode", 42, "cmpl-1", "ok")
    assert [name for name, _ in rec.phases] == list(PHASES["decode"])
    assert rec.phases[-1][1] == pytest.approx(50.0)
    assert rec.at("kv_ready") == pytest.approx(1000.0375)
    assert parse_trace_line("room=1 req=x: pushed 3 blocks") is None


def test_phases_are_written_in_time_order() -> None:
    trace = PhaseTrace("prefill", 7, "r")
    trace.mark("received", 10.0)
    trace.mark("prefill_done", 10.5)
    trace.mark("d_asked", 10.1)  # D usually asks before the prefill is done
    rec = parse_trace_line(trace.line())
    assert rec is not None and [n for n, _ in rec.phases] == ["received", "d_asked", "prefill_done"]


@pytest.fixture
def memory_tracer() -> Iterator[tuple[object, object]]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


def test_spans_continue_the_requests_trace(memory_tracer) -> None:
    tracer, exporter = memory_tracer
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    trace = PhaseTrace("prefill", 9, "cmpl-9", trace_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    for i, phase in enumerate(PHASES["prefill"]):
        trace.mark(phase, 2000.0 + i * 0.01)
    export_spans(tracer, trace)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"pd.prefill"} | {f"pd.prefill.{p}" for p in PHASES["prefill"][1:]}
    root = spans["pd.prefill"]
    assert f"{root.context.trace_id:032x}" == trace_id and f"{root.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert root.attributes["pd.room"] == "9" and root.attributes["pd.request_id"] == "cmpl-9"
    push = spans["pd.prefill.push_done"]
    assert push.parent.span_id == root.context.span_id
    assert (push.end_time - push.start_time) == pytest.approx(10_000_000, abs=10)  # 10 ms, in ns


def test_trace_book_emits_once_and_without_parent(memory_tracer) -> None:
    tracer, exporter = memory_tracer
    book = TraceBook("decode", tracer)
    book.get("r1", 5, "r1").mark("received", 1.0)
    book.get("r1", 5).mark("kv_ready", 1.5)
    book.emit("r1", "failed:timeout")
    book.emit("r1")  # already closed: nothing
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["pd.decode.kv_ready", "pd.decode"]
    assert spans[1].parent is None and spans[1].attributes["pd.outcome"] == "failed:timeout"


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_transfer_between_managers_traces_and_counts(rig: tm.Rig) -> None:
    handler = Lines()
    log = logging.getLogger("pd_connector.trace")
    log.addHandler(handler)
    try:
        p = rig.make("prefill", seed=3)
        d = rig.make("decode")
        room, dst, src = 991, [5, 6, 7], [1, 2, 3]
        d.mgr.add_recvs([tm.recv_job(rig, "req-d", room, dst)])
        p.mgr.add_sends([SendJob("req-p", room, src, tm.BLOCK_SIZE * len(src), 1.0, None, None)])
        d.wait_recv("req-d")
        p.wait_sent("req-p")
        d.mgr.mark_scheduled({"req-d": 9e9})
    finally:
        log.removeHandler(handler)
    block_bytes = sum(r.block_bytes for r in d.mgr.regions)
    d_stats, p_stats = d.mgr.take_stats(), p.mgr.take_stats()
    assert d_stats is not None and p_stats is not None
    assert d_stats["bytes_received"] == p_stats["bytes_sent"] == len(dst) * block_bytes
    assert len(d_stats["handshake_seconds"]) == 1 and p_stats["transfer_entries"] == [2]  # one run x 2 layers
    assert p_stats["gauges"]["rooms_held"] == {"dp0tp0": 0} and d_stats["gauges"]["loads_waiting"] == {"dp0tp0": 0}
    records = {r.side: r for r in map(parse_trace_line, handler.lines) if r is not None}
    assert set(records) == {"prefill", "decode"}
    assert records["prefill"].room == records["decode"].room == room
    assert [n for n, _ in records["decode"].phases] == ["admitted", "asked_p", "kv_ready", "scheduled"]
    assert {n for n, _ in records["prefill"].phases} == {
        "received",
        "prefill_done",
        "d_asked",
        "push_started",
        "push_done",
    }
