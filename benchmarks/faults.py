"""Fault campaign: 2 P + 2 D + the Router (resume on) under seeded faults; nothing hangs, leaks or lies.

    python benchmarks/faults.py --ci --out faults.json          # CI size: every fault class, >= 100 requests
    python benchmarks/faults.py --requests 1000 --seed 7        # the long run
    python benchmarks/faults.py --seed 7 --requests 1000        # replays that run's plans

Steps: the tiny model (``launch.tiny_model``); its colocated answers (one plain `vllm serve`, stopped
before anything else starts) for a pool of prompts; the stack (``benchmarks.faults_stack``: P's
bootstrap servers and rank ports behind the fault shims of ``launch.fault_shim``); each prompt's time
to first token through the Router; then the plans (``benchmarks.faults_plan``), ``--concurrency`` at a
time, each with its fault (``benchmarks.faults_inject``); at the end every instance's KV usage and held
rooms must be back to baseline within ``room_timeout_s`` + 1 s (``benchmarks.faults_checks``).

Output: one JSON (``--out``, and stdout) with the seed, per fault class {requests, ok, explicit_errors,
aborted, applied, violations}, totals, the settle times, the shims' counters and every violating
request's record with the Router's log lines about it. Exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.faults_checks import (  # noqa: E402
    RequestRecord,
    Settle,
    check_request,
    check_settle,
    error_samples,
    summarize,
)
from benchmarks.faults_client import Outcome, body_of, call  # noqa: E402
from benchmarks.faults_inject import Injector, jitter  # noqa: E402
from benchmarks.faults_plan import Fault, Prompt, RequestPlan, draw_plans, prompt_pool  # noqa: E402
from benchmarks.faults_stack import (  # noqa: E402
    CLIENT_DEADLINE_S,
    ROOM_TIMEOUT_S,
    START_TIMEOUT_S,
    Instance,
    Stack,
    gauges,
    reference_answers,
    start_stack,
    tiny_model,
)
from launch.commands import EAGER_ENV  # noqa: E402
from launch.processes import ProcessGroup  # noqa: E402
from tests.support.serving import prompt_of_length  # noqa: E402

logger = logging.getLogger("faults")

CI_REQUESTS = 110
SETTLE_LIMIT_S = ROOM_TIMEOUT_S + 1.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    os.environ[EAGER_ENV] = "1"  # no torch.compile warm-up on any instance (the reference's too)
    t_start = time.monotonic()
    rng = random.Random(args.seed)
    pool = prompt_pool(rng)
    plans = draw_plans(rng, pool, args.requests, every_class=args.ci or args.requests >= len(Fault))
    if args.plan_only:
        counts = Counter(p.fault.value for p in plans)
        print(
            json.dumps({"seed": args.seed, "requests": len(plans), "classes": dict(sorted(counts.items()))}, indent=2)
        )
        return 0
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="pd-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    model = tiny_model(work)
    texts = {(p.length, p.salt): prompt_of_length(p.length, salt=p.salt) for p in pool}
    report: dict[str, object] = {"seed": args.seed, "requests": args.requests, "logs": str(work / "logs")}
    with ProcessGroup(work / "logs") as group:
        ref_bodies = [body_of(str(model), _as_plan(p), texts[(p.length, p.salt)]) for p in pool]
        t0 = time.monotonic()
        answers = dict(
            zip(
                [(p.length, p.salt, p.max_tokens) for p in pool],
                reference_answers(group, model, ref_bodies),
                strict=True,
            )
        )
        logger.info("colocated reference: %d answers in %.1f s", len(answers), time.monotonic() - t0)
        t0 = time.monotonic()
        stack = start_stack(group, model, rng, work)
        logger.info("2 P + 2 D + Router healthy in %.1f s", time.monotonic() - t0)
        report["stack_start_s"] = round(time.monotonic() - t0, 1)
        ttft = measure_ttft(stack, pool, texts)
        baseline = {i.name: gauges(i.url) for i in stack.instances}
        report["baseline"] = baseline
        injector = Injector(stack, texts, ttft)
        t0 = time.monotonic()
        records = run_plans(injector, plans, args.seed, args.concurrency, random.Random(args.seed + 1))
        t_last = time.monotonic()
        report["load_s"] = round(t_last - t0, 1)
        for r in records:
            check_request(
                r, answers[(r.plan.prompt.length, r.plan.prompt.salt, r.plan.prompt.max_tokens)], CLIENT_DEADLINE_S
            )
        settles = settle(stack, baseline, t_last)
        end_violations = check_settle(settles, SETTLE_LIMIT_S)
        report.update(summarize(records, pd_kv_seen=any(r.call.pd_kv is not None for r in records)))
        report["settle_s"] = {s.name: s.seconds for s in settles}
        report["settle_limit_s"] = SETTLE_LIMIT_S
        report["end_violations"] = end_violations
        report["restarts"] = {i.name: i.restarts for i in stack.instances}
        report["shims"] = {
            i.name: {"bootstrap": dict(i.shim.counts), "zmq": dict(i.shim.zmq_counts())}
            for i in stack.instances
            if i.shim
        }
        report["error_samples"] = error_samples(records)
        report["violating_requests"] = [violation_detail(stack, r, args.seed) for r in records if r.violations]
        for shim in stack.shims:
            shim.stop()
    report["elapsed_s"] = round(time.monotonic() - t_start, 1)
    out = json.dumps(report, indent=2, default=str)
    if args.out:
        Path(args.out).write_text(out)
    print(out)
    if args.records:
        Path(args.records).write_text("\n".join(json.dumps(r.as_dict()) for r in records) + "\n")
    totals = report["totals"]
    assert isinstance(totals, dict)
    bad = totals["violations"] + len(end_violations)
    print(
        f"fault campaign: {totals['requests']} requests, {bad} violation(s), {report['elapsed_s']} s", file=sys.stderr
    )
    return 1 if bad else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=20261205, help="seed of every plan (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=None, help="number of requests (default: 200; --ci: 110)")
    parser.add_argument("--ci", action="store_true", help=f"CI size: {CI_REQUESTS} requests, every fault class")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (default: %(default)s)")
    parser.add_argument("--out", help="write the JSON summary here too")
    parser.add_argument("--records", help="write every request's record here (JSON lines)")
    parser.add_argument("--plan-only", action="store_true", help="print the plans' fault classes and start nothing")
    parser.add_argument("--work-dir", help="model and logs (default: a new temporary directory)")
    args = parser.parse_args(argv)
    if args.requests is None:
        args.requests = CI_REQUESTS if args.ci else 200
    if args.requests < 1:
        parser.error(f"--requests must be at least 1, not {args.requests}")
    if args.ci and args.requests < len(Fault):
        parser.error(f"--ci needs --requests >= {len(Fault)} (one per fault class), not {args.requests}")
    return args


def _as_plan(prompt: Prompt) -> RequestPlan:
    return RequestPlan(-1, prompt, False, Fault.NONE, 0.0, 0, 0)


def measure_ttft(stack: Stack, pool: list[Prompt], texts: dict[tuple[int, int], str]) -> dict[tuple[int, int], float]:
    """Each prompt's time to first token through the Router (the best of two streamed calls), on the
    quiet stack: the timed aborts aim at fractions of it."""
    out = {}
    for p in pool:
        key = (p.length, p.salt)
        body = {"model": stack.model, "prompt": texts[key], "max_tokens": 2, "temperature": 0, "stream": True}
        best = float("inf")
        for _ in range(2):
            t0 = time.monotonic()
            got = call(stack.router_url, body, deadline_s=CLIENT_DEADLINE_S, abort_after_events=1)
            if got.outcome is Outcome.ABORTED:
                best = min(best, time.monotonic() - t0)
        out[key] = best if best != float("inf") else 0.5
    logger.info("times to first token: %s", {k: round(v, 3) for k, v in out.items()})
    return out


def run_plans(
    injector: Injector, plans: list[RequestPlan], seed: int, concurrency: int, rng: random.Random
) -> list[RequestRecord]:
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="faults-client") as pool:
        futures = []
        for plan in plans:
            futures.append(pool.submit(_one, injector, plan, f"faults-{seed}-{plan.index}"))
            time.sleep(jitter(rng))
        return [f.result() for f in futures]


def _one(injector: Injector, plan: RequestPlan, rid: str) -> RequestRecord:
    record = injector.run(plan, rid)
    level = logging.WARNING if record.call.outcome not in (Outcome.OK, Outcome.ABORTED) else logging.INFO
    logger.log(
        level, "rid=%s fault=%s stream=%s: %s in %.2f s %s %s", rid, plan.fault.value, plan.stream,
        record.call.outcome.value, record.call.seconds, record.note, record.call.detail,
    )  # fmt: skip
    return record


def settle(stack: Stack, baseline: dict[str, tuple[float, float] | None], t_last: float) -> list[Settle]:
    """Per instance, all at once: seconds after the last request until KV usage and held rooms are at
    baseline again (for one restarted after the last request: after it was healthy again)."""

    def one(inst: Instance) -> Settle:
        up_by = time.monotonic() + START_TIMEOUT_S
        while inst.down.is_set() and time.monotonic() < up_by:
            time.sleep(0.2)
        since = max(t_last, inst.up_at)
        base = baseline.get(inst.name) or (0.0, 0.0)
        while True:
            last = gauges(inst.url)
            took = time.monotonic() - since
            if last is not None and last[0] <= base[0] and last[1] <= base[1]:
                return Settle(inst.name, round(took, 2), last)
            if took > SETTLE_LIMIT_S + 5:
                return Settle(inst.name, None, last)
            time.sleep(0.2)

    with ThreadPoolExecutor(max_workers=len(stack.instances)) as pool:
        return list(pool.map(one, stack.instances))


def violation_detail(stack: Stack, record: RequestRecord, seed: int) -> dict[str, object]:
    """The record and the Router's (and every instance's) log lines naming its request id."""
    rid = f"faults-{seed}-{record.plan.index}"
    lines: dict[str, list[str]] = {}
    for proc in [stack.router, *(i.proc for i in stack.instances)]:
        if proc.log_path is None or not proc.log_path.exists():
            continue
        found = [ln for ln in proc.log_path.read_text(errors="replace").splitlines() if rid in ln]
        if found:
            lines[proc.name] = found[-12:]
    return {**record.as_dict(), "rid": rid, "log_lines": lines}


if __name__ == "__main__":
    sys.exit(main())
