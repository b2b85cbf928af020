"""Predict one request's TTFT and D's TPOT for each path it could take, from live signals.

Paths (``Path``):

- ``PD``: a prefill instance P computes the prompt (less what P's prefix cache holds) and
  pushes the whole prompt's KV to the decode instance D;
- ``LOCAL``: D prefills the request itself, in its own steps, beside its running decodes;
- ``DELTA``: as PD, but the part of the prompt D already holds in its prefix cache is not pushed.

Equations (ms; ``m`` the StepModel of the instance named, ``B`` its token budget):

- P wait: ``m_P.drain_ms(queued + in_flight, B_P)``; own: ``m_P.chunked_prefill_ms(L - cached_P, cached_P, B_P)``;
- PD / DELTA: TTFT = P wait + P own (+ push + one D step when the first token comes from D);
  D's first gap (token 1 -> 2) = push of ``L`` (PD) or ``L - cached_D`` (DELTA) tokens + one D step;
- LOCAL: TTFT = residual of D's current step (half a step) + ``m_D.drain_ms(D's queued prefill tokens)``
  + ``m_D.chunked_prefill_ms(L - cached_D, cached_D, B_D, batch, context)``, all beside D's batch;
  the running requests each wait the extra step time of every prefill D has ahead, queued ones included
  (``stall_ms``);
- D's share of time prefilling (``duty``): its recent local prefill time (``DecoderLoad.recent_prefill_ms``,
  :mod:`proxy.planning.duty`) plus this prefill's own, over the duty window (capped at :data:`MAX_DUTY`).
  Prefills arriving back to back leave D's streams only the time between them.

``Prediction.tpot_ms`` is the mean TPOT D's requests see over the next ``horizon_tokens`` tokens:
one decode step (``recent_itl_ms`` scaled by the model's step ratio when given) plus the
stall or first gap spread over the horizon; for LOCAL at least one decode step / (1 - duty).
Each path's TTFT is multiplied by the pair's measured / predicted ratio for that path
(``local_ttft_scale``, ``remote_ttft_scale``; 1.0 until the Router has samples). Every call is
pure O(1) arithmetic.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from proxy.planning.duty import DUTY_WINDOW_MS
from proxy.planning.step_model import StepModel, TransferModel

#: The largest share of D's time the LOCAL prediction counts as prefilling (keeps step / (1 - duty) finite).
MAX_DUTY = 0.95


class Path(enum.Enum):
    PD = "pd"
    LOCAL = "local"
    DELTA = "delta"


@dataclass(frozen=True)
class PrefillerLoad:
    """A P instance's live load: prompt tokens waiting and being computed."""

    queued_tokens: int = 0
    in_flight_tokens: int = 0
    budget: int = 2048  # --max-num-batched-tokens


@dataclass(frozen=True)
class DecoderLoad:
    """A D instance's live load."""

    running_batch: int = 0
    context_tokens: int = 0
    queued_prefill_tokens: int = 0  # local prefills waiting on D
    recent_itl_ms: float | None = None
    budget: int = 2048
    recent_prefill_ms: float = 0.0  # local prefill time D spent lately, decayed (proxy.planning.duty)


@dataclass(frozen=True)
class RequestView:
    prompt_tokens: int
    cached_on_p: int = 0
    cached_on_d: int = 0
    horizon_tokens: int = 64  # expected output tokens after the first: one-off gaps spread over them

    def __post_init__(self) -> None:
        if self.prompt_tokens <= 0:
            raise ValueError(f"RequestView: prompt_tokens={self.prompt_tokens} must be positive")
        for name in ("cached_on_p", "cached_on_d"):
            value = getattr(self, name)
            if not 0 <= value <= self.prompt_tokens:
                raise ValueError(f"RequestView: {name}={value} outside 0..prompt_tokens={self.prompt_tokens}")


@dataclass(frozen=True)
class PairState:
    """What the Router knows about one candidate (P, D) pair and the request."""

    request: RequestView
    p: PrefillerLoad
    d: DecoderLoad


@dataclass(frozen=True)
class Prediction:
    path: Path
    ttft_ms: float
    tpot_ms: float  # mean TPOT of D's requests over the horizon
    stall_ms: float  # extra time D's running requests wait (LOCAL) or the first gap (PD, DELTA)


@dataclass
class PathModel:
    """The models of a P and a D, and whether the first token comes from P (the first-token path)."""

    p_model: StepModel
    d_model: StepModel
    transfer: TransferModel
    first_token_from_p: bool = True
    #: Measured / predicted TTFT of this pair's recent requests of about this prompt length, per
    #: path (the Router's :meth:`proxy.planning.live.PathChooser.observe_ttft`): what the step
    #: models leave out (HTTP, scheduling, a prefill slowed by the decodes beside it) scales the
    #: path's TTFT. 1.0: no samples.
    local_ttft_scale: float = 1.0
    remote_ttft_scale: float = 1.0

    def d_step_ms(self, d: DecoderLoad, extra_requests: int, extra_context: int) -> float:
        model_now = self.d_model.decode_step_ms(d.running_batch, d.context_tokens)
        model_next = self.d_model.decode_step_ms(d.running_batch + extra_requests, d.context_tokens + extra_context)
        if d.recent_itl_ms is not None and d.running_batch > 0 and model_now > 0:
            return d.recent_itl_ms * model_next / model_now
        return model_next

    def predict(self, path: Path, state: PairState) -> Prediction:
        req, p, d = state.request, state.p, state.d
        prompt = req.prompt_tokens
        horizon = max(1, req.horizon_tokens)
        step_d = self.d_step_ms(d, 1, prompt)
        if path is Path.LOCAL:
            uncached = prompt - req.cached_on_d
            residual = 0.5 * self.d_model.decode_step_ms(d.running_batch, d.context_tokens) if d.running_batch else 0.0
            wait = self.d_model.drain_ms(d.queued_prefill_tokens, d.budget, d.running_batch, d.context_tokens)
            own = self.d_model.chunked_prefill_ms(
                uncached, req.cached_on_d, d.budget, d.running_batch, d.context_tokens
            )
            ttft = (residual + wait + own) * self.local_ttft_scale
            # the running batch's wait: every prefill step D has ahead (the local prefills queued
            # before this one and this one) less the decode steps they replace
            room = max(1, d.budget - d.running_batch)
            steps = -(-uncached // room) + -(-d.queued_prefill_tokens // room)
            stall = (
                max(0.0, wait + own - steps * self.d_model.decode_step_ms(d.running_batch, d.context_tokens))
                if d.running_batch
                else 0.0
            )
            duty = min(MAX_DUTY, (d.recent_prefill_ms + own) / DUTY_WINDOW_MS)  # queued ones are in recent
            return Prediction(path, ttft, max(step_d + stall / horizon, step_d / (1.0 - duty)), stall)
        uncached_p = prompt - req.cached_on_p
        wait_p = self.p_model.drain_ms(p.queued_tokens + p.in_flight_tokens, p.budget)
        own_p = self.p_model.chunked_prefill_ms(uncached_p, req.cached_on_p, p.budget)
        pushed = prompt if path is Path.PD else prompt - req.cached_on_d
        gap = self.transfer.push_ms(pushed) + step_d
        ttft = (wait_p + own_p + (0.0 if self.first_token_from_p else gap)) * self.remote_ttft_scale
        tpot = step_d + (gap - step_d) / horizon if self.first_token_from_p else step_d
        return Prediction(path, ttft, tpot, gap)
