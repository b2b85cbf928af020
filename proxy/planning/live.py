"""The Router's per-request path choice from live signals: :class:`PathChooser`.

For each request the Router asks :meth:`PathChooser.decide` where it prefills, before any
backend call. The chooser reads, with no I/O:

- P's load: its prompt tokens queued and in flight (the pool's leases, ``in_flight_tokens``);
- D's load: its requests in flight (the running batch), the prompt tokens of requests it is
  prefilling itself that have not answered yet, the predicted time of the prefills it was sent
  lately (:class:`proxy.planning.duty.PrefillDuty`: how much of its time went to prefilling), and
  its recent inter-token latency (measured on the streams the Router relays);
- the prompt's cached part on P and on D: an approximate prefix index per instance
  (:class:`proxy.upstream.prefix_tree.PrefixTree`) of the prompts each has computed (recorded when
  a request ends well, so requests sent together do not count each other as cached), counted in
  whole KV blocks of ``--prefix-block-tokens`` tokens as vLLM's prefix cache holds them;
- a step-time model per instance (:class:`proxy.planning.step_model.StepModel`, from
  ``--path-model`` or the defaults) rescaled as the Router runs: a prefill answered by an
  instance that had nothing else in flight is a clean sample of its prefill time as the Router
  sees it (HTTP and the first token included); the running ratio of such samples to the model's
  prediction scales the instance's prefill terms, and an instance with too few samples of its own
  (a decoder that rarely prefills alone) takes the ratio of every instance's samples, so P and D
  are compared on the same footing;
- the KV push model (:class:`proxy.planning.step_model.TransferModel`);
- how far each path's predicted TTFT was from the TTFT the client then got: per instance (P for
  the remote paths, D for the local one), per path and per prompt-length class (a doubling), the
  running measured / predicted ratio of the streamed requests answered by their first attempt
  (:meth:`PathChooser.observe_ttft`) scales that path's next predictions. It takes in what the step
  models leave out: the HTTP and scheduling cost of a short prompt, a local prefill slowed by the
  decodes beside it.

It hands them to the ``--path-policy`` (:mod:`proxy.planning.path_policy`) and counts the
decision (``pd_router_path_total{path,reason}``). A decision is a few dictionary reads, two
prefix-tree walks of the prompt and O(1) arithmetic.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.planning.duty import PrefillDuty
from proxy.planning.path_policy import PATH_POLICIES, PathChoice, PathOptions
from proxy.planning.predict import DecoderLoad, PairState, Path, PathModel, PrefillerLoad, RequestView
from proxy.planning.step_model import StepModel, TransferModel, calibration_models
from proxy.upstream.pool import BackendState
from proxy.upstream.prefix_tree import PrefixTree, prompt_key

logger = logging.getLogger("proxy")

#: Output tokens assumed for a request that names no ``max_tokens`` (the horizon a stall spreads over).
DEFAULT_HORIZON = 16
#: Weight of a new inter-token latency measurement in D's running average.
ITL_WEIGHT = 0.2
#: Characters of prompts remembered per instance (its prefix index's bound).
INDEX_CHARS = 4 * 1024 * 1024
#: Weight of a new sample in an instance's (and the pool's) measured / predicted prefill ratio.
SCALE_WEIGHT = 0.2
#: Samples of its own an instance needs before its own ratio is used (else the pool's).
OWN_SAMPLES = 5
#: Tokens per KV block the prefix caches hold (vLLM caches whole blocks; a shorter match counts as none).
DEFAULT_BLOCK_TOKENS = 32
#: Weight of a new request's measured / predicted TTFT in its path's running correction.
TTFT_WEIGHT = 0.3
#: Bounds of a path's TTFT correction (a wild sample or a stalled instance cannot make a path look free or hopeless).
TTFT_SCALE_MIN, TTFT_SCALE_MAX = 0.25, 8.0


@dataclass
class ModelSet:
    """Step-time models per role and the push model (``--path-model FILE``: ``launch.plan``'s calibration)."""

    p: StepModel = field(default_factory=StepModel)
    d: StepModel = field(default_factory=StepModel)
    transfer: TransferModel = field(default_factory=TransferModel)

    @classmethod
    def load(cls, path: str | None) -> ModelSet:
        """The models of ``path`` (``{"step": {...}, "p": {...}, "d": {...}, "transfer": {...}}``), or defaults."""
        if path is None:
            return cls()
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--path-model {path}: {exc}") from None
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "--path-model") -> ModelSet:
        roles, transfer = calibration_models(data, where)
        return cls(roles["p"], roles["d"], transfer)


@dataclass(frozen=True, slots=True)
class Decided:
    """One request's path choice, with what the chooser needs to account for it afterwards."""

    choice: PathChoice
    p: BackendState | None
    d: BackendState | None
    key: str
    tokens: int
    #: LOCAL: D's predicted time to prefill it (what it adds to D's prefill duty).
    local_ms: float = 0.0


class PathChooser:
    """Decides each request's path (``--path-policy``) and keeps the live signals it reads."""

    def __init__(
        self,
        policy: str,
        options: PathOptions,
        models: ModelSet,
        metrics: Any = None,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if policy not in PATH_POLICIES:
            raise ValueError(f"--path-policy {policy!r}: unknown (choose from {', '.join(PATH_POLICIES)})")
        self.name = policy
        self.policy = PATH_POLICIES[policy]
        self.options = options
        self.defaults = models
        self.metrics = metrics
        self.block_tokens = max(1, block_tokens)
        self._models: dict[BackendState, StepModel] = {}
        #: Measured / predicted prefill time: per instance (with its sample count), and over all of them.
        self._scale: dict[BackendState, tuple[float, int]] = {}
        self._pool_scale = 1.0
        self._index: dict[BackendState, PrefixTree] = {}
        #: D: prompt tokens of local prefills sent and not answered yet.
        self._local_pending: dict[BackendState, int] = {}
        #: D: running average of the inter-token latency of the streams relayed from it (ms).
        self._itl: dict[BackendState, float] = {}
        #: D: the predicted time of the local prefills sent to it lately, decayed.
        self._duty: dict[BackendState, PrefillDuty] = {}
        #: (instance, local path?, prompt-length class) -> the TTFT correction (measured / predicted).
        self._ttft_scale: dict[tuple[BackendState, bool, int], float] = {}
        self._clock = clock

    # -- the decision --------------------------------------------------------------------------

    def decide(
        self,
        body: Mapping[str, Any],
        tokens: int,
        p: BackendState | None,
        d: BackendState | None,
        *,
        first_token_from_p: bool,
    ) -> Decided:
        """Where a request (``body``, ~``tokens`` prompt tokens) prefills, given the pair routing picked."""
        if d is None:
            return self._count(Decided(PathChoice(Path.PD, "no_decoder"), p, d, "", tokens))
        key = prompt_key(body)
        if p is None:
            return self._count(Decided(PathChoice(Path.LOCAL, "no_prefiller"), p, d, key, tokens))
        prompt = max(1, tokens)
        duty = self._duty.get(d)
        cached_d = self._cached(d, key, prompt)
        state = PairState(
            RequestView(prompt, self._cached(p, key, prompt), cached_d, _horizon(body)),
            PrefillerLoad(0, p.in_flight_tokens),
            DecoderLoad(
                d.in_flight,
                0,
                self._local_pending.get(d, 0),
                self._itl.get(d),
                recent_prefill_ms=duty.recent_ms(self._now_ms()) if duty is not None else 0.0,
            ),
        )
        length = _length_class(prompt)
        model = PathModel(
            self.model(p),
            self.model(d),
            self.defaults.transfer,
            first_token_from_p,
            local_ttft_scale=self._ttft_scale.get((d, True, length), 1.0),
            remote_ttft_scale=self._ttft_scale.get((p, False, length), 1.0),
        )
        choice = self.policy(state, self.options, model)
        local_ms = model.d_model.prefill_ms(prompt - cached_d, cached_d) if choice.local else 0.0
        return self._count(Decided(choice, p, d, key, tokens, local_ms))

    def pd_only(self) -> Decided:
        """The decision of ``always-pd`` (counted), made without reading any signal."""
        return self._count(Decided(PathChoice(Path.PD, "policy"), None, None, "", 0))

    def _count(self, decided: Decided) -> Decided:
        if self.metrics is not None:
            self.metrics.path(decided.choice.path.value, decided.choice.reason)
        return decided

    def _cached(self, state: BackendState, key: str, prompt: int) -> int:
        """Prompt tokens ``state``'s prefix cache may hold (its index's match, in proportion), below the prompt."""
        tree = self._index.get(state)
        if tree is None or not key:
            return 0
        matched = tree.match(key)
        if not matched:
            return 0
        tokens = int(prompt * matched / len(key)) // self.block_tokens * self.block_tokens
        return min(prompt - 1, tokens)

    def model(self, state: BackendState) -> StepModel:
        """``state``'s step-time model: its role's default, prefill terms scaled by what the Router measured."""
        model = self._models.get(state)
        if model is None:
            model = self._models[state] = self._scaled(state)
        return model

    def _base(self, state: BackendState) -> StepModel:
        return self.defaults.p if state.backend.role == "prefill" else self.defaults.d

    def _scaled(self, state: BackendState) -> StepModel:
        own, count = self._scale.get(state, (1.0, 0))
        factor = own if count >= OWN_SAMPLES else self._pool_scale
        base = self._base(state)
        data = {**base.to_dict(), "quadratic": base.quadratic}
        for term in ("a", "b", "c"):
            data[term] *= factor
        return StepModel.from_dict(data)

    # -- what the Router tells it --------------------------------------------------------------

    def sent(self, decided: Decided, d: BackendState) -> None:
        """The request went out to ``d`` to prefill locally: its prompt tokens wait on D until it answers."""
        if decided.choice.local:
            self._local_pending[d] = self._local_pending.get(d, 0) + decided.tokens
            duty = self._duty.get(d)
            if duty is None:
                duty = self._duty[d] = PrefillDuty()
            duty.add(self._now_ms(), decided.local_ms)

    def _now_ms(self) -> float:
        return self._clock() * 1000.0

    def computed(self, decided: Decided, p: BackendState | None, d: BackendState | None) -> None:
        """The request ended well on ``p`` (None: D prefilled it) and ``d``: their prefix caches hold its prompt."""
        if not decided.key:
            return
        if d is not None:
            self._tree(d).insert(decided.key)
        if p is not None and p.backend.role == "prefill":
            self._tree(p).insert(decided.key)

    def local_answered(self, decided: Decided, d: BackendState) -> None:
        """D's local prefill of ``decided`` ended (its first byte came, or it failed)."""
        left = self._local_pending.get(d, 0) - decided.tokens
        if left > 0:
            self._local_pending[d] = left
        else:
            self._local_pending.pop(d, None)

    def observe_prefill(self, state: BackendState, tokens: int, ms: float) -> None:
        """``state`` prefilled ``tokens`` prompt tokens in ``ms`` with nothing else in flight."""
        if tokens <= 0 or ms <= 0:
            return
        predicted = self._base(state).prefill_ms(tokens)
        if predicted <= 0:
            return
        ratio = ms / predicted
        own, count = self._scale.get(state, (ratio, 0))
        self._scale[state] = ((1 - SCALE_WEIGHT) * own + SCALE_WEIGHT * ratio if count else ratio, count + 1)
        self._pool_scale = (1 - SCALE_WEIGHT) * self._pool_scale + SCALE_WEIGHT * ratio
        self._models.clear()  # rebuilt with the new ratios when next asked

    def observe_ttft(self, decided: Decided, ms: float) -> None:
        """The client got the first token of ``decided``'s streamed answer ``ms`` after the Router took it
        (first attempt): the path's correction moves toward measured / predicted."""
        predicted = decided.choice.predicted_ttft_ms
        state = decided.d if decided.choice.local else decided.p
        if predicted is None or predicted <= 0 or ms <= 0 or state is None:
            return
        key = (state, decided.choice.local, _length_class(max(1, decided.tokens)))
        scale = self._ttft_scale.get(key, 1.0)  # the prediction was made with it: move it by the miss
        moved = scale * (1.0 + TTFT_WEIGHT * (ms / predicted - 1.0))
        self._ttft_scale[key] = min(TTFT_SCALE_MAX, max(TTFT_SCALE_MIN, moved))

    def observe_itl(self, d: BackendState, ms: float) -> None:
        """A stream relayed from ``d`` had a mean inter-token latency of ``ms``."""
        if ms <= 0:
            return
        old = self._itl.get(d)
        self._itl[d] = ms if old is None else (1 - ITL_WEIGHT) * old + ITL_WEIGHT * ms

    def forget(self, state: BackendState) -> None:
        """``state`` left the pool."""
        for table in (self._models, self._scale, self._index, self._local_pending, self._itl, self._duty):
            table.pop(state, None)  # type: ignore[attr-defined]
        for key in [key for key in self._ttft_scale if key[0] is state]:
            del self._ttft_scale[key]

    def _tree(self, state: BackendState) -> PrefixTree:
        tree = self._index.get(state)
        if tree is None:
            tree = self._index[state] = PrefixTree(INDEX_CHARS)
        return tree


def _length_class(tokens: int) -> int:
    """A prompt length's class for the TTFT corrections: one per doubling, everything up to 64 tokens one."""
    return max(0, tokens.bit_length() - 6)


def _horizon(body: Mapping[str, Any]) -> int:
    """Output tokens after the first the request asks for (the gap of a path spreads over them)."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value - 1
    return DEFAULT_HORIZON
