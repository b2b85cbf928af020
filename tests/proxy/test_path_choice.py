"""Per-request path choice (``--path-policy``): the policies, the live chooser, and the Router serving a
request on D alone (an ordinary vLLM request: no P, no ``kv_transfer_params``)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from proxy.planning.duty import DUTY_WINDOW_MS, PrefillDuty
from proxy.planning.live import ModelSet, PathChooser
from proxy.planning.path_policy import PATH_POLICIES, PathOptions, adaptive, non_cached, threshold
from proxy.planning.predict import DecoderLoad, PairState, Path, PathModel, PrefillerLoad, RequestView
from proxy.planning.step_model import StepModel, TransferModel
from proxy.router_config import Backend
from proxy.router_metrics import RouterMetrics
from proxy.upstream.pool import BackendPool, BackendState
from tests.support.router_rig import (
    REPO_ROOT,
    Backends,
    RouterFactory,
    http_client,
    new_rid,
    records,
    request_body,
)

MODEL = PathModel(StepModel(), StepModel(), TransferModel(), first_token_from_p=True)


def _state(prompt: int, *, cached_d: int = 0, p_tokens: int = 0, d_batch: int = 0, horizon: int = 31) -> PairState:
    return PairState(
        RequestView(prompt, 0, cached_d, horizon), PrefillerLoad(0, p_tokens), DecoderLoad(running_batch=d_batch)
    )


# --- the policies ---------------------------------------------------------------------------


def test_static_policies_follow_their_published_rules() -> None:
    options = PathOptions()
    # Dynamo's rule: local only when the uncached part is short AND a small part of the prompt.
    assert threshold(_state(1000, cached_d=600), options, MODEL).path is Path.LOCAL
    assert threshold(_state(1000), options, MODEL).path is Path.PD  # nothing cached: 100% uncached
    assert threshold(_state(5000, cached_d=2000), options, MODEL).path is Path.DELTA  # 3000 uncached
    # llm-d's rule: local up to --non-cached-tokens uncached tokens.
    assert non_cached(_state(400), options, MODEL).path is Path.LOCAL
    assert non_cached(_state(4000, cached_d=3600), options, MODEL).path is Path.LOCAL
    assert non_cached(_state(4000, cached_d=1000), options, MODEL).path is Path.DELTA
    assert non_cached(_state(4000), PathOptions(non_cached_tokens=8000), MODEL).path is Path.LOCAL
    for name in ("always-pd", "always-local"):
        choice = PATH_POLICIES[name](_state(100), options, MODEL)
        assert (choice.path, choice.reason) == ((Path.PD if name == "always-pd" else Path.LOCAL), "policy")


def test_adaptive_goes_local_when_p_is_busy_and_d_is_free() -> None:
    options = PathOptions()
    idle = adaptive(_state(1024), options, MODEL)
    assert idle.path is Path.PD and idle.reason == "lower_ttft"  # a tie keeps D's batch free
    assert idle.predicted_ttft_ms is not None and idle.predicted_tpot_ms is not None
    busy = adaptive(_state(1024, p_tokens=3 * 1024), options, MODEL)
    assert busy.path is Path.LOCAL and busy.reason == "lower_ttft"
    assert busy.predicted_ttft_ms is not None and idle.predicted_ttft_ms is not None
    assert busy.predicted_ttft_ms < MODEL.predict(Path.PD, _state(1024, p_tokens=3 * 1024)).ttft_ms


def test_adaptive_keeps_d_within_the_tpot_slo() -> None:
    # P is busy, so D would prefill faster, but D's 8 running streams would each wait a 1,900-token
    # prefill spread over few tokens: over the SLO, P keeps the prompt.
    state = _state(1900, p_tokens=4 * 1900, d_batch=8, horizon=8)
    local = MODEL.predict(Path.LOCAL, state)
    remote = MODEL.predict(Path.PD, state)
    assert local.ttft_ms < remote.ttft_ms
    slo = (local.tpot_ms + remote.tpot_ms) / 2  # between the two predictions
    choice = adaptive(state, PathOptions(tpot_slo_ms=slo), MODEL)
    assert (choice.path, choice.reason) == (Path.PD, "tpot_slo")
    loose = adaptive(state, PathOptions(tpot_slo_ms=10 * local.tpot_ms), MODEL)
    assert loose.path is Path.LOCAL


def test_adaptive_margin_keeps_near_ties_on_p() -> None:
    state = _state(512, p_tokens=200)
    local, remote = MODEL.predict(Path.LOCAL, state), MODEL.predict(Path.PD, state)
    assert local.ttft_ms < remote.ttft_ms < local.ttft_ms / 0.5
    margin = 1 - local.ttft_ms / remote.ttft_ms
    assert adaptive(state, PathOptions(local_margin=margin / 2), MODEL).path is Path.LOCAL
    assert adaptive(state, PathOptions(local_margin=min(0.99, margin * 2)), MODEL).reason == "within_margin"


@pytest.mark.parametrize(
    ("field", "value"),
    [("threshold_ratio", 1.5), ("tpot_slo_ms", 0.0), ("local_margin", 1.0), ("non_cached_tokens", -1)],
)
def test_options_name_the_bad_value(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=str(value)):
        PathOptions(**{field: value})  # type: ignore[arg-type]


# --- the live chooser -----------------------------------------------------------------------


def _pool() -> tuple[BackendPool, BackendState, BackendState]:
    pool = BackendPool((Backend("prefill", "127.0.0.1", 1, 2),), (Backend("decode", "127.0.0.1", 3),))
    return pool, pool.active["prefill"][0], pool.active["decode"][0]


def test_chooser_reads_p_load_and_counts_each_decision() -> None:
    pool, p, d = _pool()
    metrics = RouterMetrics(pool)
    chooser = PathChooser("adaptive", PathOptions(), ModelSet(), metrics)
    body = {"prompt": "x" * 4000, "max_tokens": 32}
    assert chooser.decide(body, 1000, p, d, first_token_from_p=True).choice.path is Path.PD
    lease = pool.lease(p, 4000)  # P busy with four prompts of this size
    decided = chooser.decide(body, 1000, p, d, first_token_from_p=True)
    assert decided.choice.path is Path.LOCAL
    lease.release()
    text = metrics.render().decode()
    assert 'pd_router_path_total{path="pd",reason="lower_ttft"} 1.0' in text
    assert 'pd_router_path_total{path="local",reason="lower_ttft"} 1.0' in text


def test_chooser_index_makes_a_repeated_prompt_delta_and_counts_pending_local_work() -> None:
    _, p, d = _pool()
    chooser = PathChooser("non-cached", PathOptions(non_cached_tokens=100), ModelSet())
    body = {"prompt": "shared prefix " * 100, "max_tokens": 8}
    first = chooser.decide(body, 400, p, d, first_token_from_p=False)
    assert first.choice.path is Path.PD
    # Sent together with the first (a burst): nothing is cached until the first request is computed.
    assert chooser.decide(body, 400, p, d, first_token_from_p=False).choice.path is Path.PD
    chooser.computed(first, p, d)
    # The same prompt again: D holds it (its prefix cache after the first request), only a token is left.
    again = chooser.decide(body, 400, p, d, first_token_from_p=False)
    assert again.choice.path is Path.LOCAL
    chooser.sent(again, d)
    longer = chooser.decide({"prompt": body["prompt"] + "y" * 2800}, 1100, p, d, first_token_from_p=False)
    assert longer.choice.path is Path.DELTA  # a third of it cached on D, the rest pushed
    # A match shorter than one KV block (the prefix caches hold whole blocks) counts as nothing.
    short = chooser.decide({"prompt": "shared prefix " + "z" * 4000}, 1000, p, d, first_token_from_p=False)
    assert short.choice.path is Path.PD
    assert chooser._local_pending[d] == 400
    chooser.local_answered(again, d)
    assert d not in chooser._local_pending
    chooser.forget(d)
    assert chooser.decide(body, 400, p, d, first_token_from_p=False).choice.path is Path.PD


def test_chooser_rescales_prefill_times_from_idle_answers_p_and_d_alike() -> None:
    _, p, d = _pool()
    chooser = PathChooser("adaptive", PathOptions(), ModelSet())
    before = chooser.model(p).prefill_ms(1000)
    for tokens in (100, 400, 800, 1200, 1600) * 4:  # what the Router sees: 3x the defaults
        chooser.observe_prefill(p, tokens, 3 * StepModel().prefill_ms(tokens))
    assert chooser.model(p).prefill_ms(1000) == pytest.approx(3 * before, rel=0.05)
    # D had no sample of its own: it takes the pool's ratio, so P and D are compared alike.
    assert chooser.model(d).prefill_ms(1000) == pytest.approx(3 * before, rel=0.05)
    for tokens in (100, 400, 800, 1200, 1600):  # then D's own samples: 2x
        chooser.observe_prefill(d, tokens, 2 * StepModel().prefill_ms(tokens))
    assert chooser.model(d).prefill_ms(1000) == pytest.approx(2 * before, rel=0.05)
    assert chooser.model(p).prefill_ms(1000) == pytest.approx(3 * before, rel=0.05)


def test_chooser_corrects_a_paths_ttft_from_what_clients_got_per_length_class() -> None:
    pool, p, d = _pool()
    chooser = PathChooser("adaptive", PathOptions(), ModelSet())
    short, long = {"prompt": "x" * 400, "max_tokens": 32}, {"prompt": "y" * 4000, "max_tokens": 32}
    lease = pool.lease(p, 200)  # P busy: D's own prefill is predicted faster at both lengths
    first = chooser.decide(short, 100, p, d, first_token_from_p=True)
    assert first.choice.path is Path.LOCAL and first.choice.predicted_ttft_ms is not None
    predicted = first.choice.predicted_ttft_ms
    for _ in range(12):  # a 100-token prefill beside D's streams: four times what the model says
        decided = chooser.decide(short, 100, p, d, first_token_from_p=True)
        if not decided.choice.local:
            break
        chooser.observe_ttft(decided, 4 * predicted)
    assert not decided.choice.local and decided.choice.reason == "lower_ttft"
    again = chooser.decide(short, 100, p, d, first_token_from_p=True)
    assert again.choice.path is Path.PD
    # Another length class has its own correction (none yet), so 1,000-token prompts still go local.
    assert chooser.decide(long, 1000, p, d, first_token_from_p=True).choice.path is Path.LOCAL
    # A correction is bounded, and a remote sample moves P's correction, not D's.
    chooser.observe_ttft(again, 1e9)
    assert chooser._ttft_scale[(p, False, 1)] == 8.0
    lease.release()
    chooser.forget(d)
    chooser.forget(p)
    assert chooser._ttft_scale == {}


def test_prefill_duty_decays_with_the_age_of_each_prefill() -> None:
    duty = PrefillDuty()
    assert duty.recent_ms(5.0) == 0.0
    duty.add(1000.0, 400.0)
    assert duty.recent_ms(1000.0) == pytest.approx(400.0)
    assert duty.recent_ms(1000.0 + DUTY_WINDOW_MS) == pytest.approx(400.0 / math.e)
    duty.add(1000.0 + DUTY_WINDOW_MS, 400.0)  # the older one decayed, the new one whole
    assert duty.recent_ms(1000.0 + DUTY_WINDOW_MS) == pytest.approx(400.0 * (1 + 1 / math.e))


def test_local_tpot_counts_prefills_back_to_back() -> None:
    # One stream decoding; D prefilled a lot lately: its streams get only the time between prefills.
    quiet = _state(1024, d_batch=1)
    busy = PairState(quiet.request, quiet.p, DecoderLoad(running_batch=1, recent_prefill_ms=0.8 * DUTY_WINDOW_MS))
    step = MODEL.d_step_ms(quiet.d, 1, 1024)
    assert MODEL.predict(Path.LOCAL, busy).tpot_ms >= step / (1 - 0.8)
    assert MODEL.predict(Path.LOCAL, busy).tpot_ms > MODEL.predict(Path.LOCAL, quiet).tpot_ms
    assert MODEL.predict(Path.PD, busy).tpot_ms == MODEL.predict(Path.PD, quiet).tpot_ms


def test_chooser_stops_prefilling_on_d_when_its_prefills_come_back_to_back() -> None:
    # P always busy, so D's prefill is faster; each local prefill the Router sends adds to D's duty.
    _, p, d = _pool()
    now = [0.0]
    options = PathOptions(tpot_slo_ms=4 * StepModel().decode_step_ms(2, 1024))
    chooser = PathChooser("adaptive", options, ModelSet(), clock=lambda: now[0])
    body = {"prompt": "x" * 4000, "max_tokens": 32}
    p.in_flight_tokens = 4000
    d.in_flight = 1
    paths = []
    for _ in range(30):
        decided = chooser.decide(body, 1000, p, d, first_token_from_p=True)
        paths.append(decided.choice.path)
        if decided.choice.local:
            chooser.sent(decided, d)
            assert decided.local_ms == pytest.approx(chooser.model(d).prefill_ms(1000))
        now[0] += chooser.model(d).prefill_ms(1000) / 1000  # the next one as soon as this one is done
        if decided.choice.local:
            chooser.local_answered(decided, d)
    assert paths[0] is Path.LOCAL
    assert Path.PD in paths  # the duty rose past what the SLO allows
    share = paths.count(Path.LOCAL) / len(paths)
    assert 0.3 < share < 0.95, paths
    chooser.forget(d)
    assert d not in chooser._duty


def test_chooser_without_a_prefiller_goes_local() -> None:
    _, _, d = _pool()
    decided = PathChooser("always-pd", PathOptions(), ModelSet()).decide({}, 10, None, d, first_token_from_p=True)
    assert (decided.choice.path, decided.choice.reason) == (Path.LOCAL, "no_prefiller")


# --- the Router -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_always_local_sends_d_an_ordinary_request_and_p_nothing(
    backends: Backends, router_factory: RouterFactory, stream: bool
) -> None:
    router = router_factory(backends.ok_p, backends.ok_d, "--path-policy", "always-local")
    rid = new_rid("local")
    body = request_body("/v1/completions", max_tokens=8, stream=stream, kv_transfer_params={"foo": 1})
    with http_client() as client:
        response = client.post(f"{router.url}/v1/completions", json=body, headers={"X-Request-Id": rid})
        metrics = client.get(f"{router.url}/metrics").text
    assert response.status_code == 200, response.text
    assert records(backends.ok_p, rid) == []
    (d,) = records(backends.ok_d, rid)
    assert "kv_transfer_params" not in d["body"] and "bootstrap_room" not in d["body"]
    assert d["body"]["max_tokens"] == 8 and d["body"].get("stream", False) is stream
    assert 'pd_router_path_total{path="local",reason="policy"}' in metrics
    log = router.proc.log_text()
    line = next(line for line in log.splitlines() if f"rid={rid}" in line and "status=" in line)
    assert "path=local(policy)" in line and "P=- " in line and "path_local +" in line  # log line and phase trace


def test_bad_path_flags_name_the_value() -> None:
    base = ["--prefiller-hosts", "h", "--prefiller-ports", "1", "--decoder-hosts", "h", "--decoder-ports", "2"]
    for bad, named in (
        (["--path-policy", "sometimes"], "sometimes"),
        (["--threshold-ratio", "2"], "2.0"),
        (["--path-model", "/nonexistent/model.json"], "/nonexistent/model.json"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "proxy", *base, *bad], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 2, done.stderr
        assert named in done.stderr, done.stderr
