"""Request traces for the planner (``python -m launch.plan``): format, reading, generation.

A trace is JSONL, one request a line, in arrival order::

    {"arrival_s": 0.52, "prompt_tokens": 1800, "output_tokens": 64, "prefix_id": "sys-3", "prefix_tokens": 1200}

``prefix_id`` names a shared prefix (a system prompt, a document) of ``prefix_tokens`` tokens
that the prompt starts with; requests with the same ``prefix_id`` share it, and an instance
that computed or received it serves it from its prefix cache. ``prefix_id`` may be null
(``prefix_tokens`` then 0).

Generators: ``poisson`` (exponential gaps at ``rate``, independent prompts) and ``bursty``
(bursts of requests arriving together, most of them sharing one of a few prefixes).
"""

from __future__ import annotations

import enum
import json
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    prefix_id: str | None = None
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens <= 0 or self.output_tokens <= 0:
            raise ValueError(
                f"trace request: prompt_tokens={self.prompt_tokens} and output_tokens={self.output_tokens} "
                "must be positive"
            )
        if not 0 <= self.prefix_tokens <= self.prompt_tokens:
            raise ValueError(f"trace request: prefix_tokens={self.prefix_tokens} outside 0..{self.prompt_tokens}")
        if self.prefix_id is None and self.prefix_tokens:
            raise ValueError(f"trace request: prefix_tokens={self.prefix_tokens} without a prefix_id")


class TraceKind(enum.Enum):
    POISSON = "poisson"
    BURSTY = "bursty"


def read_trace(path: str | Path) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(TraceRequest(**json.loads(line)))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: bad trace line ({exc})") from exc
    return sorted(out, key=lambda r: r.arrival_s)


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(asdict(r)) + "\n")


def generate(
    kind: TraceKind,
    n: int,
    rate: float,
    *,
    prompt_range: tuple[int, int] = (64, 2000),
    output_range: tuple[int, int] = (16, 128),
    prefixes: int = 8,
    prefix_range: tuple[int, int] = (256, 1024),
    shared_share: float = 0.7,
    burst_size: int = 8,
    seed: int = 0,
) -> list[TraceRequest]:
    """``n`` requests at ``rate`` requests/s on average.

    ``bursty``: bursts of ``burst_size`` requests at the same instant (gaps between bursts are
    exponential at ``rate / burst_size``); a ``shared_share`` of requests start with one of
    ``prefixes`` shared prefixes. ``poisson``: exponential gaps, no shared prefixes.
    """
    if n <= 0 or rate <= 0:
        raise ValueError(f"trace: n={n} and rate={rate} must be positive")
    rng = random.Random(seed)
    prefix_len = {f"prefix-{i}": rng.randint(*prefix_range) for i in range(prefixes)}
    out: list[TraceRequest] = []
    t = 0.0
    for i in range(n):
        if kind is TraceKind.POISSON:
            t += rng.expovariate(rate)
        elif i % burst_size == 0:
            t += rng.expovariate(rate / burst_size)
        prompt = rng.randint(*prompt_range)
        output = rng.randint(*output_range)
        prefix_id: str | None = None
        prefix_tokens = 0
        if kind is TraceKind.BURSTY and prefixes and rng.random() < shared_share:
            prefix_id = f"prefix-{rng.randrange(prefixes)}"
            prefix_tokens = prefix_len[prefix_id]
            prompt = max(prompt, prefix_tokens + 16)
        out.append(TraceRequest(round(t, 6), prompt, output, prefix_id, prefix_tokens))
    return out
