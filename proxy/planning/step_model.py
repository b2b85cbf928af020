"""Step-time and transfer model of one vLLM instance: how long an engine step and a KV push take.

The planner's simulator (``launch.plan_sim``) and the Router's per-request path choice
(``proxy.planning.predict``) use this one model, so a plan and a live decision agree.

An engine step of vLLM V1 runs the running requests' decode tokens and, in the remaining
token budget (``--max-num-batched-tokens``), chunks of waiting prompts (chunked prefill).
Its time, in milliseconds, is modelled as::

    prefill-only step:  a + b * P + c * A
    decode-only step:   d + e * N + f * K
    mixed step:         a + b * P + c * A + e * N + f * K

where ``P`` is the prompt tokens computed in the step, ``A`` the attention work of those
chunks (sum over chunks of ``chunk_tokens * context_after_chunk``; a whole prompt of ``L``
tokens alone gives ``L * L``), ``N`` the decode batch and ``K`` the decode batch's context
tokens. ``c`` and ``f`` are optional (zero unless fitted with ``quadratic`` / ``with_context``).

``fit`` recovers the coefficients by least squares from samples; ``observe_*`` adds a sample
to a bounded window and refits with exponential forgetting (newer samples weigh more), so a
Router can refit as it runs. ``TransferModel`` gives a KV push's time from the bytes per
token of the KV layout, the measured push throughput and a fixed per-request cost.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PrefillSample:
    """One measured prefill-only step or whole prefill: ``tokens`` computed on ``context`` in ``ms``."""

    tokens: int
    ms: float
    attention: float | None = None  # sum of chunk * context; tokens**2 for a whole prompt alone

    @property
    def attention_work(self) -> float:
        return float(self.tokens) ** 2 if self.attention is None else self.attention


@dataclass(frozen=True)
class DecodeSample:
    """One measured decode-only step: ``batch`` requests holding ``context_tokens`` in ``ms``."""

    batch: int
    ms: float
    context_tokens: int = 0


def solve_least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Weighted least squares by the normal equations (tiny systems: 1 to 3 unknowns).

    A column that never varies from zero gets coefficient 0; a singular system raises ValueError
    naming the rank problem.
    """
    n = len(rows[0])
    ata = [[0.0] * n for _ in range(n)]
    aty = [0.0] * n
    for row, y, w in zip(rows, ys, weights, strict=True):
        for i in range(n):
            aty[i] += w * row[i] * y
            for j in range(n):
                ata[i][j] += w * row[i] * row[j]
    active = [i for i in range(n) if ata[i][i] > 0.0]
    m = [[ata[i][j] for j in active] + [aty[i]] for i in active]
    k = len(active)
    for col in range(k):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12 * max(1.0, abs(m[col][col])):
            raise ValueError(f"least squares: samples do not determine coefficient {active[col]} (too few distinct x)")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(k):
            if r != col and m[r][col] != 0.0:
                factor = m[r][col] / m[col][col]
                m[r] = [a - factor * b for a, b in zip(m[r], m[col], strict=True)]
    out = [0.0] * n
    for idx, i in enumerate(active):
        out[i] = m[idx][k] / m[idx][idx]
    return out


@dataclass
class StepModel:
    """Per-instance step times in ms (see the module docstring for the equations)."""

    # Defaults: this repository's 2-core CPU CI machine serving the benchmark model on one core
    # (python -m launch.plan_calibrate: benchmarks/results/2026-12-05-calibration-cpu1.json; whole
    # prefills of 64 / 1,024 / 1,900 tokens 14 / 178 / 359 ms, 3.6 ms a token at batch 1, 4.9 at 8).
    # Calibrate for anything else (--path-model, launch.plan --calibration).
    a: float = 2.0  # prefill step fixed cost
    b: float = 0.144  # ms per prompt token
    c: float = 2.33e-5  # ms per unit of attention work (chunk tokens x context)
    d: float = 3.75  # decode step fixed cost
    e: float = 0.16  # ms per request in the decode batch
    f: float = 0.0  # ms per context token held by the decode batch
    quadratic: bool = True
    with_context: bool = False
    window: int = 256
    forgetting: float = 0.98
    _prefill: deque[PrefillSample] = field(default_factory=deque, repr=False, compare=False)
    _decode: deque[DecodeSample] = field(default_factory=deque, repr=False, compare=False)

    # --- times -----------------------------------------------------------------------------
    def prefill_ms(self, tokens: int, cached: int = 0) -> float:
        """One step computing ``tokens`` prompt tokens after ``cached`` ones, nothing else in it."""
        return max(0.0, self.a + self.b * tokens + self.c * tokens * (cached + tokens))

    def decode_step_ms(self, batch: int, context_tokens: int = 0) -> float:
        """One decode-only step of ``batch`` requests holding ``context_tokens`` tokens."""
        return max(0.0, self.d + self.e * batch + self.f * context_tokens)

    def step_ms(self, prefill_tokens: int, attention: float, batch: int, context_tokens: int) -> float:
        """Any step: prefill chunks (``prefill_tokens``, ``attention``) plus ``batch`` decodes."""
        if prefill_tokens <= 0:
            return self.decode_step_ms(batch, context_tokens) if batch > 0 else 0.0
        ms = self.a + self.b * prefill_tokens + self.c * attention
        if batch > 0:
            ms += self.e * batch + self.f * context_tokens
        return max(0.0, ms)

    def chunked_prefill_ms(
        self, tokens: int, cached: int, budget: int, batch: int = 0, context_tokens: int = 0
    ) -> float:
        """Time to prefill ``tokens`` after ``cached`` in chunks of the step's token budget.

        Each step also runs the ``batch`` decodes (they take budget first, as vLLM V1's
        scheduler does). O(1): the chunks are summed in closed form.
        """
        if tokens <= 0:
            return 0.0
        room = max(1, budget - batch)
        full, last = divmod(tokens, room)
        steps = full + (1 if last else 0)
        # attention: chunk i (size room) ends at context cached + (i+1)*room
        attn = room * (full * cached + room * full * (full + 1) / 2.0)
        if last:
            attn += last * (cached + tokens)
        per_step = self.a + (self.e * batch + self.f * context_tokens if batch > 0 else 0.0)
        return max(0.0, steps * per_step + self.b * tokens + self.c * attn)

    def drain_ms(self, queued_tokens: int, budget: int, batch: int = 0, context_tokens: int = 0) -> float:
        """Time to work off ``queued_tokens`` of other prompts (their attention term left out)."""
        if queued_tokens <= 0:
            return 0.0
        room = max(1, budget - batch)
        steps = math.ceil(queued_tokens / room)
        per_step = self.a + (self.e * batch + self.f * context_tokens if batch > 0 else 0.0)
        return max(0.0, steps * per_step + self.b * queued_tokens)

    # --- fitting ---------------------------------------------------------------------------
    def fit(self, prefill: Iterable[PrefillSample] = (), decode: Iterable[DecodeSample] = ()) -> StepModel:
        """Fit the coefficients in place from samples (unweighted); returns self."""
        pre, dec = list(prefill), list(decode)
        self._fit(pre, [1.0] * len(pre), dec, [1.0] * len(dec))
        return self

    def _fit(self, pre: list[PrefillSample], pw: list[float], dec: list[DecodeSample], dw: list[float]) -> None:
        if len({s.tokens for s in pre}) >= (3 if self.quadratic else 2):
            rows = [[1.0, float(s.tokens)] + ([s.attention_work] if self.quadratic else []) for s in pre]
            coef = solve_least_squares(rows, [s.ms for s in pre], pw)
            self.a, self.b = coef[0], coef[1]
            self.c = coef[2] if self.quadratic else 0.0
        if len({s.batch for s in dec}) >= 2:
            rows = [[1.0, float(s.batch)] + ([float(s.context_tokens)] if self.with_context else []) for s in dec]
            coef = solve_least_squares(rows, [s.ms for s in dec], dw)
            self.d, self.e = coef[0], coef[1]
            self.f = coef[2] if self.with_context else 0.0

    def observe_prefill(self, sample: PrefillSample) -> None:
        """Add a live prefill sample and refit (window of ``window``, weight ``forgetting**age``)."""
        self._prefill.append(sample)
        while len(self._prefill) > self.window:
            self._prefill.popleft()
        self._refit()

    def observe_decode(self, sample: DecodeSample) -> None:
        """Add a live decode-step sample and refit (window of ``window``, weight ``forgetting**age``)."""
        self._decode.append(sample)
        while len(self._decode) > self.window:
            self._decode.popleft()
        self._refit()

    def _refit(self) -> None:
        pre, dec = list(self._prefill), list(self._decode)
        pw = [self.forgetting ** (len(pre) - 1 - i) for i in range(len(pre))]
        dw = [self.forgetting ** (len(dec) - 1 - i) for i in range(len(dec))]
        try:
            self._fit(pre, pw, dec, dw)
        except ValueError:
            pass  # keep the previous coefficients until the window determines new ones

    # --- dump ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("a", "b", "c", "d", "e", "f")}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepModel:
        known = {"a", "b", "c", "d", "e", "f", "quadratic", "with_context", "window", "forgetting"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"step model: unknown keys {sorted(unknown)} (known: {sorted(known)})")
        return cls(**data)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes of K and V one token holds across all layers of a standard attention KV layout."""
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if value <= 0:
            raise ValueError(f"kv_bytes_per_token: {name}={value} must be positive")
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass
class TransferModel:
    """KV push time: ``fixed_ms + tokens * bytes_per_token / push_bytes_per_s``.

    ``observe(bytes, ms)`` folds a measured push into the throughput (exponential average with
    weight ``1 - forgetting`` on the new measurement); pushes under 1 ms of data time only
    update nothing, they measure the fixed cost rather than the link.
    """

    # Defaults: the benchmark model (6 layers x 2 KV heads x 64 dims x K,V x 2 bytes) over
    # Mooncake TCP on loopback, a rough guess for this 2-core CPU machine. Calibrate.
    bytes_per_token: int = 3072
    push_bytes_per_s: float = 500e6
    fixed_ms: float = 5.0
    #: The prefiller's own time per pushed token (copying the KV onto the wire on its cores, which its
    #: next engine step waits for where they are the same cores: a CPU instance). 0: the push is off them.
    sender_ms_per_token: float = 0.0
    forgetting: float = 0.9

    def push_ms(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.fixed_ms + tokens * self.bytes_per_token / self.push_bytes_per_s * 1e3

    def sender_ms(self, tokens: int) -> float:
        """The prefiller's engine time a push of ``tokens`` takes (``sender_ms_per_token``)."""
        return max(0, tokens) * self.sender_ms_per_token

    def observe(self, nbytes: int, ms: float) -> None:
        data_ms = ms - self.fixed_ms
        if nbytes <= 0 or data_ms < 1.0:
            return
        measured = nbytes / (data_ms / 1e3)
        self.push_bytes_per_s = self.forgetting * self.push_bytes_per_s + (1 - self.forgetting) * measured

    def to_dict(self) -> dict[str, Any]:
        return {
            "bytes_per_token": self.bytes_per_token,
            "push_bytes_per_s": self.push_bytes_per_s,
            "fixed_ms": self.fixed_ms,
            "sender_ms_per_token": self.sender_ms_per_token,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransferModel:
        known = {"bytes_per_token", "push_bytes_per_s", "fixed_ms", "sender_ms_per_token", "forgetting"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"transfer model: unknown keys {sorted(unknown)} (known: {sorted(known)})")
        return cls(**data)


def calibration_models(data: Any, where: str) -> tuple[dict[str, StepModel], TransferModel]:
    """The step model of each role (``p``, ``d``, ``c``: ``step`` with the role's own keys over it) and the
    push model of a calibration JSON (``python -m launch.plan_calibrate``); ValueError names ``where``."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: a JSON object is expected")
    unknown = set(data) - {"step", "p", "d", "c", "transfer"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: step, p, d, c, transfer)")
    step = dict(data.get("step") or {})
    roles = {key: StepModel.from_dict({**step, **dict(data.get(key) or {})}) for key in ("p", "d", "c")}
    return roles, TransferModel.from_dict(dict(data.get("transfer") or {}))
