"""The planner's step-time / transfer model, the per-path prediction and the /metrics fit."""

from __future__ import annotations

import pytest

from proxy.planning.path_policy import PathOptions, adaptive
from proxy.planning.predict import DecoderLoad, PairState, Path, PathModel, PrefillerLoad, RequestView
from proxy.planning.prom_fit import fit_from_prometheus
from proxy.planning.step_model import (
    DecodeSample,
    PrefillSample,
    StepModel,
    TransferModel,
    kv_bytes_per_token,
)

TRUE = StepModel(a=30.0, b=0.2, c=1e-4, d=8.0, e=0.6, f=0.002)


def test_fit_recovers_prefill_and_decode_coefficients() -> None:
    pre = [PrefillSample(t, TRUE.prefill_ms(t)) for t in (32, 100, 500, 1000, 2500, 4000)]
    dec = [
        DecodeSample(n, TRUE.decode_step_ms(n, k), k)
        for n, k in ((1, 100), (4, 3000), (8, 900), (16, 20000), (32, 5000), (2, 40000))
    ]
    fitted = StepModel(quadratic=True, with_context=True).fit(pre, dec)
    for name in ("a", "b", "c", "d", "e", "f"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-6, abs=1e-9), name


def test_linear_fit_leaves_quadratic_term_at_zero() -> None:
    line = StepModel(a=12.0, b=0.5, c=0.0)
    pre = [PrefillSample(t, line.prefill_ms(t)) for t in (10, 200, 900)]
    fitted = StepModel(quadratic=False).fit(pre)
    assert (fitted.a, fitted.b, fitted.c) == (pytest.approx(12.0), pytest.approx(0.5), 0.0)


def test_fit_with_one_distinct_size_keeps_coefficients() -> None:
    model = StepModel(a=5.0, b=1.0)
    model.fit([PrefillSample(100, 999.0), PrefillSample(100, 998.0)])
    assert (model.a, model.b) == (5.0, 1.0)


def test_online_refit_window_forgets_old_samples() -> None:
    old, new = StepModel(d=20.0, e=2.0), StepModel(d=5.0, e=0.5)
    model = StepModel(window=40, forgetting=0.9)
    for i in range(100):
        model.observe_decode(DecodeSample(1 + i % 8, old.decode_step_ms(1 + i % 8)))
    assert (model.d, model.e) == (pytest.approx(20.0), pytest.approx(2.0))
    for i in range(10):  # window still mostly old samples, but the newest weigh most
        model.observe_decode(DecodeSample(1 + i % 8, new.decode_step_ms(1 + i % 8)))
    assert abs(model.d - 5.0) < abs(model.d - 20.0)
    for i in range(40):  # the window holds only new samples now
        model.observe_decode(DecodeSample(1 + i % 8, new.decode_step_ms(1 + i % 8)))
    assert (model.d, model.e) == (pytest.approx(5.0), pytest.approx(0.5))


def test_chunked_prefill_sums_the_steps() -> None:
    for tokens, cached, budget, batch, ctx in (
        (5000, 0, 2048, 0, 0),
        (3000, 700, 512, 6, 9000),
        (100, 50, 4096, 2, 10),
    ):
        left, done, total = tokens, cached, 0.0
        room = budget - batch
        while left:
            chunk = min(room, left)
            total += TRUE.step_ms(chunk, chunk * (done + chunk), batch, ctx)
            done, left = done + chunk, left - chunk
        assert TRUE.chunked_prefill_ms(tokens, cached, budget, batch, ctx) == pytest.approx(total)


def test_transfer_model() -> None:
    assert kv_bytes_per_token(num_layers=6, num_kv_heads=2, head_dim=64, dtype_bytes=2) == 3072
    with pytest.raises(ValueError, match="num_kv_heads=0"):
        kv_bytes_per_token(6, 0, 64)
    t = TransferModel(bytes_per_token=1000, push_bytes_per_s=1e6, fixed_ms=2.0, forgetting=0.5)
    assert t.push_ms(0) == 0.0
    assert t.push_ms(500) == pytest.approx(2.0 + 500.0)
    t.observe(nbytes=1_000_000, ms=252.0)  # 4 MB/s measured -> halfway at forgetting 0.5
    assert t.push_bytes_per_s == pytest.approx(2.5e6)
    assert TransferModel.from_dict(t.to_dict()).push_ms(10) == pytest.approx(t.push_ms(10))
    with pytest.raises(ValueError, match="unknown keys"):
        TransferModel.from_dict({"bandwidth": 1})


def _models() -> PathModel:
    return PathModel(StepModel(), StepModel(), TransferModel())


def test_pd_and_delta_arithmetic() -> None:
    pm = _models()
    state = PairState(
        RequestView(1500, cached_on_p=0, cached_on_d=1000, horizon_tokens=10), PrefillerLoad(3000, 0), DecoderLoad()
    )
    m, t = pm.p_model, pm.transfer
    pd, delta = pm.predict(Path.PD, state), pm.predict(Path.DELTA, state)
    assert pd.ttft_ms == pytest.approx(m.drain_ms(3000, 2048) + m.chunked_prefill_ms(1500, 0, 2048))
    assert delta.ttft_ms == pd.ttft_ms  # first token from P: pushing less only shortens D's first gap
    step = pm.d_model.decode_step_ms(1, 1500)
    assert pd.stall_ms == pytest.approx(t.push_ms(1500) + step)
    assert delta.stall_ms == pytest.approx(t.push_ms(500) + step)
    assert pd.tpot_ms == pytest.approx(step + t.push_ms(1500) / 10)


def _choose(pm: PathModel, state: PairState, tpot_slo_ms: float) -> Path:
    """The ``adaptive`` policy's path with no margin: the lowest predicted TTFT within the TPOT SLO."""
    return adaptive(state, PathOptions(tpot_slo_ms=tpot_slo_ms, local_margin=0.0), pm).path


def test_local_versus_pd_flips_with_load() -> None:
    pm = _models()
    req = RequestView(800, horizon_tokens=32)
    busy_p = PairState(req, PrefillerLoad(queued_tokens=20_000), DecoderLoad(running_batch=2, context_tokens=1000))
    assert _choose(pm, busy_p, 100) is Path.LOCAL
    busy_d = PairState(req, PrefillerLoad(), DecoderLoad(running_batch=2, queued_prefill_tokens=20_000))
    assert _choose(pm, busy_d, 100) is Path.PD
    # LOCAL is faster with P busy, but its stall on a big batch breaks a tight TPOT SLO
    big_batch = PairState(req, PrefillerLoad(queued_tokens=5000), DecoderLoad(running_batch=64, context_tokens=64_000))
    local = pm.predict(Path.LOCAL, big_batch)
    remote = pm.predict(Path.PD, big_batch)
    assert local.ttft_ms < remote.ttft_ms and local.tpot_ms > remote.tpot_ms
    assert _choose(pm, big_batch, (local.tpot_ms + remote.tpot_ms) / 2) is Path.PD
    assert _choose(pm, big_batch, float("inf")) is Path.LOCAL


def test_recent_itl_scales_the_decode_step() -> None:
    pm = _models()
    d = DecoderLoad(running_batch=4, context_tokens=0, recent_itl_ms=30.0)
    model = pm.d_model
    assert pm.d_step_ms(d, 1, 0) == pytest.approx(30.0 * model.decode_step_ms(5) / model.decode_step_ms(4))


def test_prediction_is_constant_work() -> None:
    calls = {"n": 0}

    class Counting(StepModel):
        def step_ms(self, *args: float) -> float:  # type: ignore[override]
            calls["n"] += 1
            return super().step_ms(*args)

        def decode_step_ms(self, *args: int) -> float:  # type: ignore[override]
            calls["n"] += 1
            return super().decode_step_ms(*args)

    pm = PathModel(Counting(), Counting(), TransferModel())
    counts = []
    for prompt, queued in ((100, 0), (1_000_000, 10**9)):
        calls["n"] = 0
        state = PairState(
            RequestView(prompt, horizon_tokens=8), PrefillerLoad(queued, 0, 64), DecoderLoad(8, 100, queued, None, 64)
        )
        for path in Path:
            pm.predict(path, state)
        counts.append(calls["n"])
    assert counts[0] == counts[1] <= 20


def test_request_view_names_bad_values() -> None:
    with pytest.raises(ValueError, match="cached_on_d=900 outside 0..prompt_tokens=800"):
        RequestView(800, cached_on_d=900)
    with pytest.raises(ValueError, match="unknown keys"):
        StepModel.from_dict({"alpha": 1.0})


# Written by hand from vLLM 0.32's metric names (vllm/v1/metrics/loggers.py); two engines.
# The per-request histograms follow a linear prefill time of 20 ms + 0.5 ms/token, so matched
# quantiles lie on that line; mean ITL 12 ms at 4 running requests.
METRICS = """
# HELP vllm:request_prefill_kv_computed_tokens Histogram of new KV tokens computed during prefill
# TYPE vllm:request_prefill_kv_computed_tokens histogram
vllm:request_prefill_kv_computed_tokens_bucket{engine="0",le="100.0",model_name="m"} 6.0
vllm:request_prefill_kv_computed_tokens_bucket{engine="0",le="500.0",model_name="m"} 30.0
vllm:request_prefill_kv_computed_tokens_bucket{engine="0",le="1000.0",model_name="m"} 48.0
vllm:request_prefill_kv_computed_tokens_bucket{engine="0",le="2000.0",model_name="m"} 60.0
vllm:request_prefill_kv_computed_tokens_bucket{engine="0",le="+Inf",model_name="m"} 60.0
vllm:request_prefill_kv_computed_tokens_bucket{engine="1",le="100.0",model_name="m"} 4.0
vllm:request_prefill_kv_computed_tokens_bucket{engine="1",le="500.0",model_name="m"} 20.0
vllm:request_prefill_kv_computed_tokens_bucket{engine="1",le="1000.0",model_name="m"} 32.0
vllm:request_prefill_kv_computed_tokens_bucket{engine="1",le="2000.0",model_name="m"} 40.0
vllm:request_prefill_kv_computed_tokens_bucket{engine="1",le="+Inf",model_name="m"} 40.0
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="m"} 60.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="m"} 40000.0
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.07",model_name="m"} 10.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.27",model_name="m"} 50.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.52",model_name="m"} 80.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="1.02",model_name="m"} 100.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 100.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 100.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 30.0
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 500.0
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 500.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 4.0
vllm:inter_token_latency_seconds_count{engine="1",model_name="m"} 500.0
vllm:inter_token_latency_seconds_sum{engine="1",model_name="m"} 8.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
"""


def test_fit_from_prometheus_text() -> None:
    model = fit_from_prometheus([METRICS], StepModel(quadratic=False, e=0.5))
    assert model.a == pytest.approx(20.0, abs=0.5)
    assert model.b == pytest.approx(0.5, rel=0.01)
    assert model.c == 0.0
    assert model.e == 0.5  # one decode point: only the fixed cost moves
    assert model.decode_step_ms(4) == pytest.approx(12.0)


def test_fit_from_prometheus_without_histograms_keeps_the_model() -> None:
    base = StepModel()
    assert fit_from_prometheus(["# nothing here\nvllm:num_requests_running 2\n"], base).to_dict() == base.to_dict()
