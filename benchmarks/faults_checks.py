"""The fault campaign's invariants (benchmarks/faults.py), on records only: no stack needed to test them.

Per request: it ended within its deadline (no hang); its answer is the colocated reference's text or an
explicit error (never wrong text, never an empty or unfinished 200, never a cut stream without an error
event); a client abort only where one was planned; a ``usage.pd_kv`` record that says tokens were
recomputed names why (``recompute_reason``). At the end: every instance's KV cache usage and held rooms
are back to their baseline within the room lease (``room_timeout_s``) + 1 s after the last request.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from benchmarks.faults_client import Call, Outcome
from benchmarks.faults_plan import Fault, RequestPlan

#: Seconds a call may overrun its deadline (the client's own polling) before it counts as a hang.
DEADLINE_SLACK_S = 2.0


@dataclass
class RequestRecord:
    plan: RequestPlan
    call: Call
    #: Whether the planned environment fault was set off (a kill is skipped while its role has an
    #: instance down; a drain while any instance is down) and what it did.
    applied: bool = True
    note: str = ""
    violations: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {
            "index": self.plan.index,
            "fault": self.plan.fault.value,
            "stream": self.plan.stream,
            "prompt_len": self.plan.prompt.length,
            "max_tokens": self.plan.prompt.max_tokens,
            "outcome": self.call.outcome.value,
            "status": self.call.status,
            "seconds": self.call.seconds,
            "events": self.call.events,
            "applied": self.applied,
            "note": self.note,
            "detail": self.call.detail,
            "violations": self.violations,
        }


def check_request(record: RequestRecord, reference: str, deadline_s: float) -> list[str]:
    """The per-request invariants; the violations found (also kept on ``record``)."""
    call, fault = record.call, record.plan.fault
    bad: list[str] = []
    if call.outcome is Outcome.HANG:
        bad.append(f"hang: {call.detail}")
    elif call.seconds > deadline_s + DEADLINE_SLACK_S:
        bad.append(f"ended after {call.seconds:.1f} s, past its {deadline_s:.0f} s deadline")
    if call.outcome is Outcome.UNCLEAR:
        bad.append(f"unclear answer (HTTP {call.status}): {call.detail}")
    if call.outcome is Outcome.ABORTED and not fault.is_abort:
        bad.append(f"the client aborted without an abort planned: {call.detail}")
    if call.outcome is Outcome.OK:
        if not call.text:
            bad.append("empty answer with HTTP 200")
        elif call.text != reference:
            bad.append(f"wrong text: got {call.text[:120]!r}, the colocated reference is {reference[:120]!r}")
    if call.pd_kv is not None:
        bad += check_pd_kv(call.pd_kv)
    record.violations = bad
    return bad


def check_pd_kv(pd_kv: object) -> list[str]:
    """A ``usage.pd_kv`` record (or a list of them) with recomputed tokens must name its reason."""
    items = pd_kv if isinstance(pd_kv, list) else [pd_kv]
    bad = []
    for item in items:
        if not isinstance(item, dict):
            bad.append(f"usage.pd_kv is not an object: {item!r}")
            continue
        recomputed = item.get("recomputed_tokens") or 0
        if (
            isinstance(recomputed, (int, float))
            and recomputed > 0
            and item.get("recompute_reason") in (None, "", "none")
        ):
            bad.append(f"{recomputed} token(s) recomputed without a recompute_reason: {item}")
    return bad


@dataclass(frozen=True)
class Settle:
    """One instance after the last request: seconds until its gauges were back at baseline (None: never
    within the limit), and the last (kv usage, rooms held) seen."""

    name: str
    seconds: float | None
    last: tuple[float, float] | None


def check_settle(settles: Sequence[Settle], limit_s: float) -> list[str]:
    bad = []
    for s in settles:
        if s.seconds is None or s.seconds > limit_s:
            usage, rooms = s.last if s.last is not None else (float("nan"), float("nan"))
            bad.append(
                f"{s.name}: KV usage {usage:.4f} and rooms held {rooms:g} not back to baseline within "
                f"{limit_s:.1f} s (room_timeout_s + 1 s) after the last request"
            )
    return bad


def summarize(records: Sequence[RequestRecord], pd_kv_seen: bool) -> dict[str, object]:
    """Per fault class {requests, ok, explicit_errors, aborted, applied, recomputes (by reason),
    violations}, and totals."""
    classes: dict[str, dict[str, object]] = {}
    for fault in Fault:
        mine = [r for r in records if r.plan.fault is fault]
        if not mine:
            continue
        counts = Counter(r.call.outcome for r in mine)
        classes[fault.value] = {
            "requests": len(mine),
            "ok": counts[Outcome.OK],
            "explicit_errors": counts[Outcome.ERROR],
            "aborted": counts[Outcome.ABORTED],
            "applied": sum(r.applied for r in mine),
            "recomputes": dict(Counter(reason for r in mine for reason in recompute_reasons(r.call.pd_kv))),
            "violations": [{"request": r.plan.index, "details": r.violations} for r in mine if r.violations],
        }
    counts = Counter(r.call.outcome for r in records)
    return {
        "classes": classes,
        "totals": {
            "requests": len(records),
            "ok": counts[Outcome.OK],
            "explicit_errors": counts[Outcome.ERROR],
            "aborted": counts[Outcome.ABORTED],
            "violations": sum(bool(r.violations) for r in records),
        },
        "recompute_labels": "checked" if pd_kv_seen else "skipped: no answer carried usage.pd_kv",
    }


def recompute_reasons(pd_kv: object) -> list[str]:
    """The ``recompute_reason`` of each record in ``pd_kv`` that recomputed tokens."""
    items = pd_kv if isinstance(pd_kv, list) else [pd_kv] if pd_kv is not None else []
    return [
        str(i.get("recompute_reason")) for i in items if isinstance(i, dict) and (i.get("recomputed_tokens") or 0) > 0
    ]


def error_samples(records: Sequence[RequestRecord], limit: int = 8) -> Mapping[str, list[str]]:
    """A few explicit error messages per fault class, for the report."""
    out: dict[str, list[str]] = {}
    for r in records:
        if r.call.outcome is Outcome.ERROR:
            seen = out.setdefault(r.plan.fault.value, [])
            if len(seen) < limit and r.call.detail not in seen:
                seen.append(r.call.detail)
    return out
