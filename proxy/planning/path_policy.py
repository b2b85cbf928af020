"""Path policies (``--path-policy``): does D prefill a request itself, or does P prefill it and push the KV?

A policy is a function ``(PairState, PathOptions, PathModel) -> PathChoice``. :data:`PATH_POLICIES`
maps each ``--path-policy`` name to its function, and the function's docstring is its help text.
Adding a policy is one function and one line in the table. The Router
(:mod:`proxy.planning.live`) and the planner's simulator (``launch.plan_sim``) decide through
this one table, so a plan and a live decision agree.

Every policy returns a :class:`PathChoice`: the path (``Path.LOCAL``: D prefills; ``Path.PD``: P
prefills and pushes the whole prompt's KV; ``Path.DELTA``: as PD, D already holds a prefix of the
prompt, so only the rest is pushed), a short ``reason`` (the label of
``pd_router_path_total{path,reason}``) and the predicted TTFT / TPOT of the chosen path where the
policy computed them. Every call is O(1) arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from proxy.planning.predict import PairState, Path, PathModel, Prediction


@dataclass(frozen=True, slots=True)
class PathOptions:
    """The ``--path-policy`` tuning flags (defaults: the rules' published defaults)."""

    #: ``threshold`` (NVIDIA Dynamo's conditional disaggregation): local when the uncached part of
    #: the prompt is under this many tokens ...
    threshold_tokens: int = 2048
    #: ... and under this fraction of the prompt.
    threshold_ratio: float = 0.7
    #: ``non-cached`` (llm-d's prefix-based decider): disaggregate when more tokens than this are not
    #: cached on D, else local.
    non_cached_tokens: int = 512
    #: ``adaptive``: a path whose predicted TPOT on D exceeds this (ms) is ruled out.
    tpot_slo_ms: float = 50.0
    #: ``adaptive``: D prefills only when its predicted TTFT beats the remote path's by this fraction
    #: (a tie keeps D's batch free of prefill work).
    local_margin: float = 0.1

    def __post_init__(self) -> None:
        if self.threshold_tokens < 0:
            raise ValueError(f"--threshold-tokens {self.threshold_tokens}: must be >= 0")
        if not 0.0 <= self.threshold_ratio <= 1.0:
            raise ValueError(f"--threshold-ratio {self.threshold_ratio}: must be within 0..1")
        if self.non_cached_tokens < 0:
            raise ValueError(f"--non-cached-tokens {self.non_cached_tokens}: must be >= 0")
        if not self.tpot_slo_ms > 0:
            raise ValueError(f"--tpot-slo-ms {self.tpot_slo_ms}: must be > 0")
        if not 0.0 <= self.local_margin < 1.0:
            raise ValueError(f"--local-margin {self.local_margin}: must be within 0..1 (exclusive)")


@dataclass(frozen=True, slots=True)
class PathChoice:
    """Where one request prefills, why, and what the policy predicted for it (ms; None: not computed)."""

    path: Path
    reason: str
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None

    @property
    def local(self) -> bool:
        return self.path is Path.LOCAL


PathPolicy = Callable[[PairState, PathOptions, PathModel], PathChoice]


def _remote(state: PairState) -> Path:
    """PD, or DELTA when D holds a prefix of the prompt (the connector then loads only the rest)."""
    return Path.DELTA if state.request.cached_on_d > 0 else Path.PD


def _uncached_on_d(state: PairState) -> int:
    return state.request.prompt_tokens - state.request.cached_on_d


def always_pd(state: PairState, options: PathOptions, model: PathModel) -> PathChoice:
    """P prefills every request and pushes its KV to D (DELTA when D holds a prefix)"""
    return PathChoice(_remote(state), "policy")


def always_local(state: PairState, options: PathOptions, model: PathModel) -> PathChoice:
    """D prefills every request itself (no P, no KV push: colocated serving on the decoders)"""
    return PathChoice(Path.LOCAL, "policy")


def threshold(state: PairState, options: PathOptions, model: PathModel) -> PathChoice:
    """NVIDIA Dynamo's rule: D prefills when the uncached part of the prompt is under
    --threshold-tokens and under --threshold-ratio of the prompt, else P"""
    uncached = _uncached_on_d(state)
    short = uncached < options.threshold_tokens
    small = uncached < options.threshold_ratio * state.request.prompt_tokens
    if short and small:
        return PathChoice(Path.LOCAL, "short_uncached")
    return PathChoice(_remote(state), "long_uncached" if not short else "mostly_uncached")


def non_cached(state: PairState, options: PathOptions, model: PathModel) -> PathChoice:
    """llm-d's rule: P prefills when more than --non-cached-tokens tokens are not cached on D, else D"""
    if _uncached_on_d(state) > options.non_cached_tokens:
        return PathChoice(_remote(state), "non_cached_above")
    return PathChoice(Path.LOCAL, "non_cached_below")


def adaptive(state: PairState, options: PathOptions, model: PathModel) -> PathChoice:
    """the path with the lowest TTFT predicted from live load (P's queued prompt tokens, D's batch,
    the prefix D holds, fitted step times, push throughput) whose predicted TPOT on D stays within
    --tpot-slo-ms; D prefills only when that beats P by --local-margin"""
    remote = model.predict(_remote(state), state)
    local = model.predict(Path.LOCAL, state)
    slo = options.tpot_slo_ms
    if local.tpot_ms > slo and remote.tpot_ms <= slo:
        return _chose(remote, "tpot_slo")
    if remote.tpot_ms > slo and local.tpot_ms <= slo:
        return _chose(local, "tpot_slo")
    if remote.tpot_ms > slo and local.tpot_ms > slo:
        return _chose(remote, "no_path_fits_slo")
    if local.ttft_ms < remote.ttft_ms * (1.0 - options.local_margin):
        return _chose(local, "lower_ttft")
    return _chose(remote, "lower_ttft" if remote.ttft_ms <= local.ttft_ms else "within_margin")


def _chose(prediction: Prediction, reason: str) -> PathChoice:
    return PathChoice(prediction.path, reason, prediction.ttft_ms, prediction.tpot_ms)


#: ``--path-policy`` name -> policy (the first is the default).
PATH_POLICIES: dict[str, PathPolicy] = {
    "adaptive": adaptive,
    "always-pd": always_pd,
    "always-local": always_local,
    "threshold": threshold,
    "non-cached": non_cached,
}


def describe_path_policy(name: str) -> str:
    """One policy's help text: its function's docstring, on one line."""
    doc = PATH_POLICIES[name].__doc__ or ""
    return " ".join(doc.split()).rstrip(".")
