"""Draw the phases of a run's PD requests as a waterfall: ``python -m launch.trace LOG_DIR --out trace.png``.

Reads every ``*.log`` in LOG_DIR (``launch.local`` writes ``prefill.log``, ``decode.log`` and
``router.log``), keeps the phase-trace summary lines (``pd_connector.trace``) and joins them
by bootstrap room. The picture has one bar group per request (rows: Router, P, D; one colored
segment per phase, from the previous phase to it; x: seconds since the first request), and
the command prints where the median request spent its time. Needs matplotlib (the ``trace``
extra).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

from pd_connector.trace import PHASES, TraceRecord, parse_trace_line

SIDES = ("router", "prefill", "decode")
Request = dict[str, TraceRecord]  # side -> its trace of one room


def load_traces(log_dir: str | Path) -> dict[int, Request]:
    """room -> side -> trace, from every ``*.log`` under ``log_dir`` (the last line of a side wins)."""
    rooms: dict[int, Request] = {}
    for path in sorted(Path(log_dir).glob("*.log")):
        with open(path, errors="replace") as f:
            for line in f:
                if "phase trace (" in line and (rec := parse_trace_line(line)) is not None:
                    rooms.setdefault(rec.room, {})[rec.side] = rec
    return rooms


def segments(rec: TraceRecord) -> list[tuple[str, float, float]]:
    """(phase, start, end) wall-clock seconds: each phase spans from the previous phase to it."""
    times = [(name, rec.t0 + ms / 1e3) for name, ms in rec.phases]
    return [(name, prev, t) for (_, prev), (name, t) in zip(times, times[1:], strict=False)]


def _start(request: Request) -> float:
    return min(rec.t0 for rec in request.values())


def summary(rooms: dict[int, Request]) -> str:
    """Median time per side and phase, and the median request's total as the Router saw it."""
    if not rooms:
        return "no phase traces found"
    durations: dict[tuple[str, str], list[float]] = {}
    for request in rooms.values():
        for side, rec in request.items():
            for name, start, end in segments(rec):
                durations.setdefault((side, name), []).append((end - start) * 1e3)
    totals = [r["router"].phases[-1][1] for r in rooms.values() if "router" in r and r["router"].phases]
    lines = [f"{len(rooms)} requests" + (f", median total {statistics.median(totals):.1f} ms" if totals else "")]
    lines.append("median request, where the time went (each phase from the previous one):")
    order = {(side, name): (i, j) for i, side in enumerate(SIDES) for j, name in enumerate(PHASES[side])}
    for key in sorted(durations, key=lambda k: order.get(k, (9, 9))):
        values = durations[key]
        lines.append(f"  {key[0]:>7} {key[1]:<13} {statistics.median(values):9.1f} ms  (n={len(values)})")
    return "\n".join(lines)


def draw(rooms: dict[int, Request], out: str | Path, title: str = "") -> int:
    """Write the waterfall PNG to ``out``; returns the number of bar groups (requests) drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    requests = sorted(rooms.items(), key=lambda kv: _start(kv[1]))
    origin = _start(requests[0][1]) if requests else 0.0
    names = sorted({name for side in SIDES for name in PHASES[side]})
    colors = {name: plt.get_cmap("tab20")(i % 20) for i, name in enumerate(names)}
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.45 * len(SIDES) * max(len(requests), 1)))
    ticks, labels = [], []
    for group, (room, request) in enumerate(requests):
        for row, side in enumerate(SIDES):
            y = group * (len(SIDES) + 1) + row
            ticks.append(y)
            labels.append(f"{side[0].upper()} {room % 100000:05d}" if row else f"R {room % 100000:05d}")
            rec = request.get(side)
            if rec is None:
                continue
            for name, start, end in segments(rec):
                ax.broken_barh([(start - origin, max(end - start, 1e-4))], (y - 0.4, 0.8), color=colors[name])
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first request")
    ax.set_title(title or f"PD phase waterfall, {len(requests)} requests (R: Router, P: prefill, D: decode)")
    used = sorted({name for _, r in requests for rec in r.values() for name, _, _ in segments(rec)})
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in used]
    if handles:
        ax.legend(handles, used, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), title="phase ends")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return len(requests)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.trace", description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", help="directory with the run's prefill.log, decode.log, router.log")
    parser.add_argument("--out", default="trace.png", help="PNG to write (default: trace.png)")
    parser.add_argument("--last", type=int, default=0, help="only the last N requests (0: all)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    rooms = load_traces(args.log_dir)
    if not rooms:
        print(f"no phase-trace lines in {args.log_dir}/*.log", file=sys.stderr)
        return 1
    if args.last > 0:
        rooms = dict(sorted(rooms.items(), key=lambda kv: _start(kv[1]))[-args.last :])
    groups = draw(rooms, args.out)
    print(summary(rooms))
    print(f"waterfall of {groups} requests written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
