"""Fit a StepModel from an instance's own ``/metrics`` text (best effort).

vLLM V1 exports (``vllm/v1/metrics/loggers.py``) histograms per request, not per step, so the
fit is indirect:

- prefill: ``vllm:request_prefill_kv_computed_tokens`` (tokens computed, prefix hits excluded)
  and ``vllm:request_prefill_time_seconds`` are two marginal distributions of the same
  requests. Prefill time grows with tokens, so their quantiles pair up (the q-th quantile of
  time belongs to the q-th quantile of tokens); the pairs at several q are the samples.
- decode: the mean of ``vllm:inter_token_latency_seconds`` against the gauge
  ``vllm:num_requests_running`` gives one point per scrape; several scrapes give a line.

Series with several label sets (one per engine) are added together. A term the text cannot
determine keeps the model's previous coefficient.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from proxy.planning.step_model import DecodeSample, PrefillSample, StepModel

PREFILL_TOKENS = "vllm:request_prefill_kv_computed_tokens"
PREFILL_TIME = "vllm:request_prefill_time_seconds"
ITL = "vllm:inter_token_latency_seconds"
RUNNING = "vllm:num_requests_running"
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)")
_LE = re.compile(r'le="([^"]*)"')


class Scrape:
    """One ``/metrics`` text: plain values and histogram buckets, summed over label sets."""

    def __init__(self, text: str) -> None:
        self.values: dict[str, float] = {}
        self.buckets: dict[str, dict[float, float]] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = _LINE.match(line)
            if m is None:
                continue
            name, labels, raw = m.group(1), m.group(3) or "", m.group(4)
            try:
                value = float(raw)
            except ValueError:
                continue
            if name.endswith("_bucket"):
                le = _LE.search(labels)
                if le is None:
                    continue
                bound = math.inf if le.group(1) == "+Inf" else float(le.group(1))
                per = self.buckets.setdefault(name[: -len("_bucket")], {})
                per[bound] = per.get(bound, 0.0) + value
            else:
                self.values[name] = self.values.get(name, 0.0) + value

    def mean(self, histogram: str) -> float | None:
        count = self.values.get(histogram + "_count", 0.0)
        return self.values.get(histogram + "_sum", 0.0) / count if count > 0 else None

    def quantile(self, histogram: str, q: float) -> float | None:
        """The q-quantile by linear interpolation inside the cumulative buckets."""
        buckets = sorted(self.buckets.get(histogram, {}).items())
        if not buckets or buckets[-1][1] <= 0:
            return None
        target = q * buckets[-1][1]
        lower, below = 0.0, 0.0
        for bound, cum in buckets:
            if cum >= target:
                if math.isinf(bound):
                    return lower
                share = (target - below) / (cum - below) if cum > below else 1.0
                return lower + share * (bound - lower)
            lower, below = bound, cum
        return lower


def prefill_samples(scrape: Scrape) -> list[PrefillSample]:
    """Quantile-matched (tokens, ms) pairs; the whole prefill of a request counts as one step."""
    out: list[PrefillSample] = []
    for q in QUANTILES:
        tokens = scrape.quantile(PREFILL_TOKENS, q)
        seconds = scrape.quantile(PREFILL_TIME, q)
        if tokens is not None and seconds is not None and tokens > 0:
            out.append(PrefillSample(tokens=round(tokens), ms=seconds * 1e3))
    return out


def decode_sample(scrape: Scrape) -> DecodeSample | None:
    itl = scrape.mean(ITL)
    running = scrape.values.get(RUNNING)
    if itl is None or running is None:
        return None
    return DecodeSample(batch=max(1, round(running)), ms=itl * 1e3)


def fit_from_prometheus(texts: Sequence[str], model: StepModel | None = None) -> StepModel:
    """Fit (a copy of) ``model`` from one or more ``/metrics`` texts of one instance.

    With fewer distinct points than coefficients, a single point moves only the fixed cost
    (``a`` for prefill, ``d`` for decode) so the line passes through it.
    """
    base = model or StepModel()
    fitted = StepModel.from_dict({**base.to_dict(), "quadratic": base.quadratic, "with_context": False})
    scrapes = [Scrape(t) for t in texts]
    pre = [s for sc in scrapes for s in prefill_samples(sc)]
    dec = [s for sc in scrapes if (s := decode_sample(sc)) is not None]
    distinct_pre = {s.tokens for s in pre}
    if len(distinct_pre) < (3 if fitted.quadratic else 2):
        fitted.quadratic = False
        fitted.c = 0.0 if len(distinct_pre) >= 2 else fitted.c
    try:
        fitted.fit(pre if len(distinct_pre) >= 2 else [], dec if len({s.batch for s in dec}) >= 2 else [])
    except ValueError:
        pass
    if len(distinct_pre) == 1:
        s = pre[0]
        fitted.a = s.ms - fitted.b * s.tokens - fitted.c * s.tokens * s.tokens
    if len({s.batch for s in dec}) == 1:
        s = dec[0]
        fitted.d = s.ms - fitted.e * s.batch
    return fitted
