"""The timing contract between P's writes and D's stop wait, derived from the active transport.

A stopped load (failed, timed out, aborted) keeps its blocks out of vLLM's reuse for ``loads.stop_wait_s``
unless P answers first: ``(1 + WRITE_RETRIES) * batch_stall_s + peer_timeout_s + STOP_MARGIN_S``, where
``batch_stall_s`` is the active backend's bound on one batch write (``BackendOptions``). The derivation per
Mooncake transport is checked on its own (pure: protocol + environment). Then a real prefill and decode
KVTransferManager (tests/support/transfer_rig.py) over a transport whose batches last longer than a
transport-blind wait would allow: D never hands a block back while a byte of P's can still land in it,
and the request ends as a named failure (vLLM gets its blocks as failed: recompute or fail, its policy).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from pd_connector.config import ConfigError, parse_config
from pd_connector.transfer import decode_side as decode_side_module
from pd_connector.transfer import loads
from pd_connector.transfer.backend import WRITE_RETRIES, TransferError, write_in_batches
from pd_connector.transfer.loads import in_flight_s, lost_wait_s, stop_wait_s
from pd_connector.transfer.mooncake import MooncakeOptions, stall_for
from pd_connector.transfer.registry import NoOptions, OptionError
from tests.support.slow_transport import Landings, late_landings, register_slow_backend, start_slow_push
from tests.support.transfer_rig import Rig, Side

#: Every variable the contract reads: unset for each test here (another test's worker may have set them in
#: this process, e.g. a prefill on the ascend transport writes ASCEND_TRANSFER_TIMEOUT), set where a test says.
TIMEOUT_ENV = (
    "MC_TRANSFER_TIMEOUT",
    "MC_TCP_PROGRESS_TIMEOUT_SEC",
    "ASCEND_TRANSFER_TIMEOUT",
    "HCCL_RDMA_TIMEOUT",
    "HCCL_RDMA_RETRY_CNT",
)


@pytest.fixture(autouse=True)
def _no_transport_timeouts_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TIMEOUT_ENV:
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------ derivation per transport


def test_tcp_by_default_is_bounded_by_the_binding_not_the_progress_deadline() -> None:
    """An unset environment: the binding waits 30 s for a batch (MC_TRANSFER_TIMEOUT), longer than the
    10 s no-progress deadline ``open`` sets: a batch that moves slowly lasts up to 30 s."""
    assert stall_for("tcp", {}) == 30.0
    options = MooncakeOptions("tcp", batch_stall_s=stall_for("tcp", {}))
    cfg = replace(parse_config("kv_consumer", {"protocol": "tcp"}), backend_options=options)
    assert stop_wait_s(cfg) == 2 * 30.0 + cfg.peer_timeout_s + loads.STOP_MARGIN_S == 67.0


def test_tcp_takes_the_users_values() -> None:
    assert stall_for("tcp", {"MC_TCP_PROGRESS_TIMEOUT_SEC": "45"}) == 45.0  # a stalled connection lasts longer
    assert stall_for("tcp", {"MC_TRANSFER_TIMEOUT": "8"}) == 10.0  # the progress deadline outlasts the binding's
    assert stall_for("tcp", {"MC_TRANSFER_TIMEOUT": "8", "MC_TCP_PROGRESS_TIMEOUT_SEC": "6"}) == 8.0
    assert stall_for("tcp", {"MC_TRANSFER_TIMEOUT": "2", "MC_TCP_PROGRESS_TIMEOUT_SEC": "3"}) == 5.0  # floor 5
    assert stall_for("tcp", {"MC_TRANSFER_TIMEOUT": "5", "MC_TCP_PROGRESS_TIMEOUT_SEC": "0"}) == 30.0  # Mooncake's


def test_ascend_follows_ascend_transfer_timeout() -> None:
    """HIXL: the user's ASCEND_TRANSFER_TIMEOUT (ms), else vLLM-Ascend's derivation from HCCL's settings."""
    assert stall_for("ascend", {}) == 33.064  # HCCL_RDMA_TIMEOUT 20, HCCL_RDMA_RETRY_CNT 7: 33064 ms
    assert stall_for("ascend", {"HCCL_RDMA_TIMEOUT": "22"}) == 123.259
    assert stall_for("ascend", {"ASCEND_TRANSFER_TIMEOUT": "10000"}) == 30.0  # the binding's 30 s outlasts it
    options = MooncakeOptions("ascend", batch_stall_s=stall_for("ascend", {"ASCEND_TRANSFER_TIMEOUT": "120000"}))
    cfg = replace(parse_config("kv_consumer", {}), backend_options=options)
    assert options.batch_stall_s == 120.0
    assert stop_wait_s(cfg) > 240.0  # two 120 s tries of one batch, then the cancel's way to P
    assert stop_wait_s(cfg) == 2 * 120.0 + cfg.peer_timeout_s + loads.STOP_MARGIN_S


def test_rdma_is_bounded_by_mooncakes_transfer_timeout() -> None:
    assert stall_for("rdma", {}) == 30.0
    assert stall_for("rdma", {"MC_TRANSFER_TIMEOUT": "90"}) == 90.0
    assert stall_for("rdma", {"MC_TRANSFER_TIMEOUT": "1"}) == 5.0  # Mooncake waits at least 5 s


def test_local_copies_have_a_small_bound() -> None:
    cfg = parse_config("kv_consumer", {"backend": "device_copy"})
    assert cfg.backend_options.batch_stall_s == NoOptions().batch_stall_s == 2.0
    assert stop_wait_s(cfg) == 2 * 2.0 + cfg.peer_timeout_s + loads.STOP_MARGIN_S
    assert in_flight_s(cfg) == 4.0
    # A lost P rank may be cut off only one way: its wait covers P's liveness too (loads.lost_wait_s).
    assert lost_wait_s(cfg) == stop_wait_s(cfg) == 11.0


def test_the_config_reads_the_environment_of_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCEND_TRANSFER_TIMEOUT", "120000")
    cfg = parse_config("kv_consumer", {"use_ascend_direct": True})
    assert cfg.backend_options.batch_stall_s == 120.0 and stop_wait_s(cfg) > 240.0
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "60")
    assert parse_config("kv_consumer", {"protocol": "rdma"}).backend_options.batch_stall_s == 60.0


@pytest.mark.parametrize(
    ("name", "value", "protocol"),
    [
        ("MC_TRANSFER_TIMEOUT", "30s", "rdma"),
        ("MC_TCP_PROGRESS_TIMEOUT_SEC", "ten", "tcp"),
        ("ASCEND_TRANSFER_TIMEOUT", "0", "ascend"),
        ("HCCL_RDMA_TIMEOUT", "x", "ascend"),
    ],
)
def test_a_bad_timeout_variable_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, protocol: str
) -> None:
    with pytest.raises(OptionError, match=f"{name}={value!r}"):
        stall_for(protocol, {name: value})
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        parse_config("kv_consumer", {"protocol": protocol})


# ------------------------------------------------------------ P's half: the batch budget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _writes(clock: Clock, durations: list[float], statuses: list[int]) -> list[int]:
    """write_in_batches over one entry with stall 10 s; each try lasts ``durations[i]`` and returns
    ``statuses[i]``; the tries made are returned."""
    tries: list[int] = []

    def batch(s: list[int], d: list[int], n: list[int]) -> int:
        clock.now += durations[len(tries)]
        tries.append(len(tries))
        return statuses[len(tries) - 1]

    write_in_batches(batch, [1], [2], [8], 4, lambda: True, what="w", peer="p", stall_s=10.0, clock=clock)
    return tries


def test_a_batch_that_failed_within_its_bound_is_tried_again() -> None:
    assert _writes(Clock(), [10.2, 3.0], [-1, 0]) == [0, 1]  # ended at its timeout (within the tolerance)


def test_no_retry_starts_that_could_end_past_the_batchs_budget(pd_logs: pytest.LogCaptureFixture) -> None:
    """The first try outlasted the transport's 10 s bound: a second one could end past 2 x 10 s after the
    batch began, which D's stop wait does not cover, so the write fails instead (and says so)."""
    clock = Clock()
    with pytest.raises(TransferError, match=r"failed with -1 after 14.0 s; not tried again.* 20 s budget"):
        _writes(clock, [14.0, 1.0], [-1, 0])
    assert "took 14.0 s, past the transport's 10 s batch bound" in pd_logs.text
    assert clock.now == 114.0  # one try only


def test_without_a_bound_nothing_is_timed() -> None:
    tries: list[int] = []

    def batch(s: list[int], d: list[int], n: list[int]) -> int:
        tries.append(1)
        return -1 if len(tries) == 1 else 0

    write_in_batches(batch, [1], [2], [8], 4, None, what="w", peer="p")
    assert len(tries) == 2


# ------------------------------------------------------------ a slow transport on the real rig

#: The transport-blind wait at this test's scale: a fixed per-batch bound (a fast TCP's, scaled down)
#: used for every transport, as D did before the bound came from the active backend.
BLIND_STALL_S, PEER_TIMEOUT_S = 0.05, 0.5
BLIND_WAIT_S = (1 + WRITE_RETRIES) * BLIND_STALL_S + PEER_TIMEOUT_S
#: The slow transport: each batch lasts three times the blind wait, within the bound it declares.
BATCH_S = 3 * BLIND_WAIT_S
STALL_S = BATCH_S + 0.2
NAME = "slow-batches"
P_BLOCKS, D_BLOCKS = [2, 4, 6, 8], [1, 3, 5, 7]


LANDINGS = Landings(BATCH_S)
register_slow_backend(NAME, STALL_S, LANDINGS)


@pytest.fixture
def backend_name() -> str:
    return NAME


@pytest.fixture
def landings() -> Landings:
    return LANDINGS.reset()


def _timed_out_load(rig: Rig, monkeypatch: pytest.MonkeyPatch, room: int) -> tuple[Side, Side, dict[str, float]]:
    """P pushes 8 one-entry batches of BATCH_S each; D's load times out (0.8 s) inside the first one.

    0.8 s leaves P's push time to start on a loaded machine (tests on both cores): a load that timed out
    before P's first batch began would see nothing land, and neither test could show anything."""
    return start_slow_push(rig, monkeypatch, room, (P_BLOCKS, D_BLOCKS), PEER_TIMEOUT_S, kv_wait_timeout_s=0.8)


def test_d_holds_the_blocks_while_a_slow_transports_batch_lands(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, landings: Landings, pd_logs: pytest.LogCaptureFixture
) -> None:
    """The batch outlasts a transport-blind wait three times over; D's wait comes from the transport's
    bound, so the blocks go back to vLLM (as failed, with the reason) only after the batch landed."""
    p, d, handed = _timed_out_load(rig, monkeypatch, 7301)
    assert d.mgr.decode is not None
    assert stop_wait_s(d.mgr.decode._cfg) > BATCH_S  # 2 x 2.0 + 0.5 + 0.2 = 4.7 s here
    d.wait_recv("d-1", timeout=20)
    p.wait_sent("p-1", timeout=20)  # P's push ended: every write it made has landed
    assert d.failed == {"d-1": D_BLOCKS}  # failed: vLLM recomputes or fails the request, never reads them
    assert landings.at, "the slow push wrote nothing: the test proves nothing"
    assert late_landings(landings, d, handed["d-1"]) == []
    assert len(landings.at) == 1  # P started no batch after D gave up
    assert "KV load failed: no KV from prefill within 0.8 s; prefill answered" in pd_logs.text
    assert any(r.levelno == logging.ERROR and "d-1" in r.getMessage() for r in pd_logs.records)


def test_a_transport_blind_wait_would_hand_the_blocks_back_too_early(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, landings: Landings
) -> None:
    """The same push with D's wait fixed at a transport-blind value: the batch lands after the blocks
    went back to vLLM. This is what the test above guards against (and shows it can see it)."""
    monkeypatch.setattr(decode_side_module, "stop_wait_s", lambda cfg, timing=None: BLIND_WAIT_S)
    p, d, handed = _timed_out_load(rig, monkeypatch, 7302)
    d.wait_recv("d-1", timeout=20)
    p.wait_sent("p-1", timeout=20)
    assert landings.at, "the slow push wrote nothing: the test proves nothing"
    late = late_landings(landings, d, handed["d-1"])
    assert late and {block for _, block in late} <= set(D_BLOCKS)
