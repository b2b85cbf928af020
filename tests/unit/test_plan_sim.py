"""The planner's simulator, trace format and CLI (``launch.plan``)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path as FsPath

import pytest

from launch.plan import load_models, topologies
from launch.plan_sim import InstanceConfig, Models, Policy, Req, Simulator
from launch.plan_trace import TraceKind, TraceRequest, generate, read_trace, write_trace
from proxy.planning.predict import DecoderLoad, PairState, Path, PathModel, PrefillerLoad, RequestView
from proxy.planning.step_model import StepModel, TransferModel

REPO = FsPath(__file__).resolve().parents[2]
MODELS = Models(
    p=StepModel(a=30.0, b=0.2, c=1e-4, d=9.0, e=0.5),
    d=StepModel(a=25.0, b=0.25, c=1e-4, d=10.0, e=0.4, f=0.001),
    c=StepModel(a=28.0, b=0.22, c=1e-4, d=8.0, e=0.6),
    transfer=TransferModel(bytes_per_token=3072, push_bytes_per_s=2e8, fixed_ms=4.0),
)
BUDGET = 1024


def _one(prompt: int, output: int, *, policy: Policy = Policy.ALWAYS_PD, **topo: int) -> Req:
    sim = Simulator(policy=policy, models=MODELS, instance=InstanceConfig(budget=BUDGET), **topo)
    sim.run([TraceRequest(0.0, prompt, output)], 1e9, 1e9)
    assert len(sim.done) == 1
    return sim.done[0]


@pytest.mark.parametrize("prompt", [300, 1024, 2500])
def test_single_request_pd_matches_the_model(prompt: int) -> None:
    r = _one(prompt, 9, p=1, d=1)
    pm = PathModel(MODELS.p, MODELS.d, MODELS.transfer)
    state = PairState(RequestView(prompt, horizon_tokens=8), PrefillerLoad(budget=BUDGET), DecoderLoad(budget=BUDGET))
    assert r.first_t - r.arrival == pytest.approx(MODELS.p.chunked_prefill_ms(prompt, 0, BUDGET))
    assert r.first_t - r.arrival == pytest.approx(pm.predict(Path.PD, state).ttft_ms)
    # D: the push, then 8 decode steps of one request whose context grows by one token a step
    steps = sum(MODELS.d.decode_step_ms(1, prompt + 1 + i) for i in range(8))
    assert r.finish_t - r.first_t == pytest.approx(MODELS.transfer.push_ms(prompt) + steps)


@pytest.mark.parametrize("prompt", [300, 2500])
def test_single_request_colocated_and_local_match_the_model(prompt: int) -> None:
    c = _one(prompt, 5, c=1)
    assert c.first_t - c.arrival == pytest.approx(MODELS.c.chunked_prefill_ms(prompt, 0, BUDGET))
    assert c.finish_t - c.first_t == pytest.approx(4 * MODELS.c.decode_step_ms(1))
    local = _one(prompt, 5, policy=Policy.ALWAYS_LOCAL, p=1, d=1)
    assert local.first_t - local.arrival == pytest.approx(MODELS.d.chunked_prefill_ms(prompt, 0, BUDGET))


def test_ttft_grows_with_load() -> None:
    medians = []
    for rate in (0.5, 2.0, 4.0):
        trace = generate(TraceKind.POISSON, 400, rate, prompt_range=(200, 1500), output_range=(8, 32), seed=3)
        result = Simulator(c=1, models=MODELS).run(trace, 1e9, 1e9)
        assert len(result.ttft_ms) == 400
        medians.append(statistics.median(result.ttft_ms))
    assert medians[0] < medians[1] < medians[2]


def test_adaptive_goes_local_where_the_model_says() -> None:
    # a long prompt occupies P (its push spread over 39 tokens keeps TPOT within the SLO);
    # a short one right after is faster on the idle D
    trace = [TraceRequest(0.0, 8000, 40), TraceRequest(0.01, 200, 4)]
    runs = {}
    for policy in (Policy.ALWAYS_PD, Policy.ADAPTIVE):
        sim = Simulator(p=1, d=1, policy=policy, models=MODELS, instance=InstanceConfig(budget=BUDGET))
        sim.run(trace, 1e9, 1e9)
        runs[policy] = {r.prompt: r for r in sim.done}
    adaptive = runs[Policy.ADAPTIVE]
    assert adaptive[8000].path is Path.PD and adaptive[200].path is Path.LOCAL
    ttft = {p: runs[p][200].first_t - runs[p][200].arrival for p in runs}
    assert ttft[Policy.ADAPTIVE] < ttft[Policy.ALWAYS_PD]


def test_closed_loop_sends_the_next_request_at_each_first_token() -> None:
    trace = [TraceRequest(99.0, 700, 16) for _ in range(6)]
    one = Simulator(p=1, d=1, models=MODELS, instance=InstanceConfig(budget=BUDGET))
    one.run(trace, 1e9, 1e9, closed_loop=1)
    alone = MODELS.p.chunked_prefill_ms(700, 0, BUDGET)
    starts = sorted(r.arrival for r in one.done)
    assert starts == pytest.approx([i * alone for i in range(6)])  # P idle at each arrival
    assert all(r.first_t - r.arrival == pytest.approx(alone) for r in one.done)
    four = Simulator(p=1, d=1, models=MODELS, instance=InstanceConfig(budget=BUDGET)).run(
        trace, 1e9, 1e9, closed_loop=4
    )
    assert statistics.median(four.ttft_ms) > 2 * alone  # four prompts share P


def test_threshold_and_non_cached_rules() -> None:
    sim = Simulator(p=1, d=1, policy=Policy.THRESHOLD, models=MODELS)
    p, d = sim.ps[0], sim.ds[0]

    def req(prompt: int, prefix: int) -> Req:
        return Req(TraceRequest(0.0, prompt, 4, "sys" if prefix else None, prefix))

    d.remember(req(2000, 1000))  # D holds the 1000-token prefix "sys"
    assert sim.choose(req(2000, 1000), p, d, 0.0) is Path.LOCAL  # 1000 uncached < 2048, ratio 0.5 < 0.7
    assert sim.choose(req(4000, 1000), p, d, 0.0) is Path.DELTA  # 3000 uncached >= 2048
    assert sim.choose(req(1500, 0), p, d, 0.0) is Path.PD  # nothing cached: ratio 1.0
    sim.policy = Policy.NON_CACHED
    assert sim.choose(req(1400, 1000), p, d, 0.0) is Path.LOCAL  # 400 non-cached <= 512
    assert sim.choose(req(1600, 1000), p, d, 0.0) is Path.DELTA


def test_prefix_cache_shortens_the_second_prefill() -> None:
    trace = [TraceRequest(0.0, 1500, 2, "doc", 1200), TraceRequest(10.0, 1500, 2, "doc", 1200)]
    sim = Simulator(c=1, models=MODELS, instance=InstanceConfig(budget=BUDGET))
    sim.run(trace, 1e9, 1e9)
    first, second = sorted(sim.done, key=lambda r: r.arrival)
    assert second.first_t - second.arrival == pytest.approx(MODELS.c.chunked_prefill_ms(300, 1200, BUDGET))
    assert second.first_t - second.arrival < first.first_t - first.arrival


def test_trace_round_trip_and_errors(tmp_path: FsPath) -> None:
    trace = generate(TraceKind.BURSTY, 50, 5.0, seed=1)
    assert any(r.prefix_id for r in trace)
    path = tmp_path / "t.jsonl"
    write_trace(path, trace)
    assert read_trace(path) == trace
    path.write_text('{"arrival_s": 0, "prompt_tokens": 10, "output_tokens": 1, "prefix_tokens": 5}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:1: .*prefix_tokens=5 without a prefix_id"):
        read_trace(path)
    with pytest.raises(ValueError, match="topology p=1 d=0 c=0"):
        Simulator(p=1)


def test_calibration_file(tmp_path: FsPath) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"step": {"a": 1.0}, "d": {"d": 3.0}, "transfer": {"fixed_ms": 9.0}}))
    models = load_models(str(path))
    assert (models.p.a, models.d.a, models.d.d, models.p.d, models.transfer.fixed_ms) == (
        1.0,
        1.0,
        3.0,
        StepModel().d,
        9.0,
    )
    path.write_text(json.dumps({"prefill": {}}))
    with pytest.raises(ValueError, match="unknown keys \\['prefill'\\]"):
        load_models(str(path))
    assert [t.name for t in topologies(3)] == ["1C", "2C", "1P1D", "3C", "1P2D", "2P1D"]


def test_cli_plans_a_generated_trace() -> None:
    # The whole command on a 1,000-request trace (a 10,000-request one plans in about 9 s on 2 cores:
    # `python -m launch.plan --requests 10000 --rate 2 --max-instances 4`; timed by hand, not here).
    cmd = [sys.executable, "-m", "launch.plan", "--requests", "1000", "--rate", "2", "--max-instances", "4"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=True)
    out = json.loads(done.stdout)
    assert out["trace"]["requests"] == 1000
    assert len(out["results"]) == 4 + 6 * 5  # 1..4 colocated; six xPyD topologies x five policies
    for row in out["results"]:
        assert row["ttft_ms"]["p50"] > 0 and row["tpot_ms"]["p99"] >= row["tpot_ms"]["p50"]
    rec = out["recommendation"]
    assert rec is not None
    least = min(r["instances"] for r in out["results"] if r["attainment"] >= 0.9)
    assert rec["instances"] == least
    assert "rough defaults" in out["models"]["source"]


def test_time_outside_the_engines_adds_to_ttft() -> None:
    base = _one(300, 5, c=1)
    sim = Simulator(
        models=Models(MODELS.p, MODELS.d, MODELS.c, MODELS.transfer, overhead_ms=12.0),
        instance=InstanceConfig(budget=BUDGET),
        c=1,
    )
    sim.run([TraceRequest(0.0, 300, 5)], 1e9, 1e9)
    late = sim.done[0]
    assert late.first_t - late.arrival == pytest.approx(base.first_t - base.arrival + 12.0)
    assert late.finish_t - late.first_t == pytest.approx(base.finish_t - base.first_t)


def test_prefiller_sends_the_kv_before_its_next_step() -> None:
    """Two prompts at once on one P (budget for one at a time): the second waits for the first's step
    and, with a sender cost, for the first push's copy on P's cores too."""
    sender = TransferModel(bytes_per_token=3072, push_bytes_per_s=2e8, fixed_ms=4.0, sender_ms_per_token=0.01)
    firsts = []
    for transfer in (MODELS.transfer, sender):
        sim = Simulator(
            models=Models(MODELS.p, MODELS.d, MODELS.c, transfer), instance=InstanceConfig(budget=1000), p=1, d=1
        )
        sim.run([TraceRequest(0.0, 1000, 4), TraceRequest(0.0, 1000, 4)], 1e9, 1e9)
        firsts.append(sorted(r.first_t for r in sim.done))
    assert firsts[1][0] == pytest.approx(firsts[0][0])  # the first prompt's token is not delayed
    assert firsts[1][1] == pytest.approx(firsts[0][1] + 1000 * 0.01)  # the second waits for the copy


def test_colocated_instances_take_requests_in_turn() -> None:
    sim = Simulator(models=MODELS, instance=InstanceConfig(budget=BUDGET), c=2)
    sim.run([TraceRequest(0.0, 300, 2) for _ in range(4)], 1e9, 1e9)
    firsts = sorted(r.first_t for r in sim.done)
    # two at a time: each instance starts on its first request at once and takes its second after it
    assert firsts[0] == pytest.approx(firsts[1]) and firsts[2] == pytest.approx(firsts[3])
    assert firsts[2] > firsts[1] + 1.0
