"""What one per-request path decision costs the Router (``--path-policy``), in microseconds.

``python benchmarks/path_decision.py`` prints one JSON object: per policy and prompt shape, the
p50 / p99 of :meth:`proxy.planning.live.PathChooser.decide` plus the prefix-index update that
follows it (:meth:`~proxy.planning.live.PathChooser.sent`), on this process's CPU, with the index
already holding ``--prompts`` earlier prompts (half of them sharing the measured prompt's first
half) and P and D carrying load. ``benchmarks/router.py`` includes this object as
``path_decision``. The decision runs on the Router's event loop before any backend call, so its
cost adds to the Router's latency one for one.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from proxy.planning.live import ModelSet, PathChooser  # noqa: E402
from proxy.planning.path_policy import PATH_POLICIES, PathOptions  # noqa: E402
from proxy.router_config import Backend  # noqa: E402
from proxy.upstream.pool import BackendPool  # noqa: E402

#: Prompt shapes: 1,900 token ids (the closed loop's longest), and a ~7,600-character text prompt.
SHAPES = ("token_ids_1900", "text_7600_chars")


def _bodies(shape: str, count: int, rng: random.Random) -> list[dict[str, Any]]:
    if shape == "token_ids_1900":
        shared = [rng.randrange(32000) for _ in range(950)]
        return [
            {"prompt": (shared if i % 2 else []) + [rng.randrange(32000) for _ in range(1900 - (950 if i % 2 else 0))]}
            for i in range(count)
        ]
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    shared_text = " ".join(rng.choice(words) for _ in range(600))
    out = []
    for i in range(count):
        own = " ".join(rng.choice(words) for _ in range(1200 if i % 2 == 0 else 600))
        out.append({"prompt": (shared_text + " " + own) if i % 2 else own, "max_tokens": 64})
    return out


def measure(policy: str, shape: str, prompts: int, calls: int, seed: int = 0) -> dict[str, float]:
    """p50 / p99 microseconds of one decision (and its index update) under ``policy`` for ``shape``."""
    rng = random.Random(seed)
    pool = BackendPool((Backend("prefill", "127.0.0.1", 1, 2),), (Backend("decode", "127.0.0.1", 3),))
    p, d = pool.active["prefill"][0], pool.active["decode"][0]
    chooser = PathChooser(policy, PathOptions(), ModelSet())
    bodies = _bodies(shape, prompts + calls, rng)
    for body in bodies[:prompts]:
        chooser.computed(chooser.decide(body, 1900, p, d, first_token_from_p=True), p, d)
    leases = [pool.lease(p, 1900) for _ in range(3)] + [pool.lease(d) for _ in range(8)]
    times = []
    for body in bodies[prompts:]:
        start = time.perf_counter()
        decided = chooser.decide(body, 1900, p, d, first_token_from_p=True)
        chooser.sent(decided, d)
        if decided.choice.local:
            chooser.local_answered(decided, d)
        chooser.computed(decided, None if decided.choice.local else p, d)
        times.append((time.perf_counter() - start) * 1e6)
    for lease in leases:
        lease.release()
    times.sort()
    return {
        "p50_us": round(statistics.median(times), 1),
        "p99_us": round(times[min(len(times) - 1, int(0.99 * len(times)))], 1),
    }


def run(prompts: int = 200, calls: int = 2000) -> dict[str, Any]:
    """Every policy and shape; ``bar_p50_us``: the acceptance bar (0.2 ms)."""
    results = {policy: {shape: measure(policy, shape, prompts, calls) for shape in SHAPES} for policy in PATH_POLICIES}
    worst = max(r["p50_us"] for by_shape in results.values() for r in by_shape.values())
    return {
        "calls": calls,
        "indexed_prompts": prompts,
        "results": results,
        "worst_p50_us": worst,
        "bar_p50_us": 200.0,
        "within_bar": worst < 200.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200, help="prompts indexed before measuring (default: 200)")
    parser.add_argument("--calls", type=int, default=2000, help="decisions measured per policy and shape")
    args = parser.parse_args()
    print(json.dumps(run(args.prompts, args.calls), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
