"""D and a prefill deployment with two DP ranks, the room's DP rank not told (transfer.dp_wait, room_release).

A real bootstrap server of DP size 2 (both ranks registered at the one P manager of the rig), a D with one
transfer thread: a load whose room has no DP rank registered yet waits without holding that thread (another
load passes it), goes on once the rank is registered, and a load that never finds its rank, or that vLLM
aborts meanwhile, tells every DP rank of P to free the room: P lets it go long before its room_timeout_s.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pd_connector.bootstrap.client import register_dp_rank, register_rank
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.messages import RegisterRank
from pd_connector.metadata import SendJob
from tests.support.loopback import HOST, free_port, wait_for
from tests.support.transfer_rig import BLOCK_SIZE, DTYPE, LAYERS, Engines, Rig, Side, recv_job

P_HOLD_S = 60.0  # P's room_timeout_s: every room in these tests is freed long before it


@pytest.fixture
def dp2_rig(engines: Engines) -> Iterator[Rig]:
    server = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=2), HOST, free_port())
    server.start()
    rig = Rig(server, engines)
    try:
        yield rig
    finally:
        rig.close()
        server.stop()


def _sides(rig: Rig, **d_extra: object) -> tuple[Side, Side]:
    p = rig.make("prefill", register=False, room_timeout_s=P_HOLD_S)
    for dp in (0, 1):  # both DP ranks at the rig's one P manager
        info = RegisterRank(1, 0, 2, dp, HOST, p.mgr.rank_port, BLOCK_SIZE, DTYPE, num_layers=LAYERS)
        assert register_rank(f"{HOST}:{rig.bport}", info, retries=3, interval_s=0.05, timeout_s=5)
    d = rig.make("decode", transfer_threads=1, **d_extra)
    return p, d


def test_a_load_waiting_for_its_dp_rank_holds_no_transfer_thread(
    dp2_rig: Rig, pd_logs: pytest.LogCaptureFixture
) -> None:
    p, d = _sides(dp2_rig)
    d.mgr.add_recvs([recv_job(dp2_rig, "d-late", 501, [1, 2])])  # no DP rank registered for room 501
    wait_for(lambda: "room=501 req=d-late: prefill" in pd_logs.text and "registered no DP rank" in pd_logs.text)
    # D's only transfer thread is free: a load told its DP rank goes through meanwhile.
    p.mgr.add_sends([SendJob("p-told", 502, [3, 4], 2 * BLOCK_SIZE)])
    d.mgr.add_recvs([recv_job(dp2_rig, "d-told", 502, [5, 6], dp_rank=1)])
    d.wait_recv("d-told")
    p.wait_sent("p-told")
    assert "d-late" not in d.recving and not d.failed
    # P registers room 501 (its request arrived) and prefills it: the parked load goes on.
    register_dp_rank(f"{HOST}:{dp2_rig.bport}", 501, 1, 5)
    p.mgr.add_sends([SendJob("p-late", 501, [7, 8], 2 * BLOCK_SIZE)])
    d.wait_recv("d-late")
    p.wait_sent("p-late")
    assert not d.failed and "room=501 req=d-late: prefill DP rank 1 registered after" in pd_logs.text


def test_a_room_whose_dp_rank_never_comes_is_freed_on_every_dp_rank(
    dp2_rig: Rig, pd_logs: pytest.LogCaptureFixture
) -> None:
    p, d = _sides(dp2_rig, kv_wait_timeout_s=1.0)
    p.mgr.add_sends([SendJob("p-lost", 601, [1, 2], 2 * BLOCK_SIZE)])  # P holds it; no DP rank registered
    d.mgr.add_recvs([recv_job(dp2_rig, "d-lost", 601, [3, 4])])
    d.wait_recv("d-lost")  # failed after kv_wait_timeout_s
    assert d.failed["d-lost"] == [3, 4]
    assert "room=601 req=d-lost: KV load failed: prefill registered no DP rank for room 601 within 1 s" in pd_logs.text
    p.wait_sent("p-lost", timeout=15)  # freed by D's cancel, not by P's 60 s hold
    assert p.stats().rooms_expired == 0
    assert "room=601 req=d-lost: prefill registered no DP rank" in pd_logs.text
    assert "every DP rank (2) of prefill told to free the room" in pd_logs.text


def test_an_abort_while_waiting_for_the_dp_rank_ends_the_load_and_frees_the_room(
    dp2_rig: Rig, pd_logs: pytest.LogCaptureFixture
) -> None:
    p, d = _sides(dp2_rig)
    d.mgr.add_recvs([recv_job(dp2_rig, "d-gone", 701, [1, 2])])
    wait_for(lambda: d.mgr.decode is not None and d.mgr.decode._dp_wait.parked("d-gone"))
    assert d.mgr.decode is not None
    d.mgr.decode.cancel(["d-gone"])
    d.wait_recv("d-gone")
    assert d.failed["d-gone"] == [1, 2]
    assert "room=701 req=d-gone: KV load failed: request aborted before prefill was asked" in pd_logs.text
    # P's prefill of the room ends after the cancel: the room is freed at once (the early cancel).
    wait_for(lambda: "every DP rank (2) of prefill told" in pd_logs.text)
    p.mgr.add_sends([SendJob("p-gone", 701, [3, 4], 2 * BLOCK_SIZE)])
    p.wait_sent("p-gone", timeout=15)
    assert p.stats().rooms_expired == 0 and p.stats().transfers_ok == 0
