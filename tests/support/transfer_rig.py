"""The transfer-manager test rig: a prefill and a decode KVTransferManager over real ZMQ and a real
bootstrap server, all in this process on loopback. KV: 2 layers x 16 blocks, vLLM CPU layout.

The bytes move through a transfer backend opened by name from the registry: the in-process one
(tests/support/inproc_backend.py, registered as "inproc") by default, the real Mooncake TCP backend
where a test is parametrized with backend_name "mooncake" (BOTH_BACKENDS). The fixtures that
build it (backend_pool, backend_name, engines, bootstrap, rig, fresh_rig) live in tests/unit/conftest.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from pd_connector.bootstrap.client import register_rank
from pd_connector.bootstrap.server import BootstrapServer, BootstrapState
from pd_connector.config import parse_config
from pd_connector.layouts.regions import memory_ranges, regions_of_kv_caches
from pd_connector.messages import RegisterRank
from pd_connector.metadata import RecvJob
from pd_connector.transfer.backend import TransferBackend
from pd_connector.transfer.device_sync import NO_DEVICE, DeviceSync
from pd_connector.transfer.manager import KVTransferManager, RankSpec
from pd_connector.transfer.registry import create_backend
from pd_connector.transfer.states import RoomState
from pd_connector.transfer.stats import StatsSnapshot
from tests.support.inproc_backend import register_inproc
from tests.support.loopback import HOST, free_port, wait_for

register_inproc()

NUM_BLOCKS = 16
BLOCK_SIZE = 16
LAYERS = 2
HEADS, HEAD_DIM = 2, 8
DTYPE = "float16"


def make_kv(heads: int = HEADS) -> dict[str, torch.Tensor]:
    """vLLM CPU layout [num_blocks, kv_heads, block_size, 2 * head_dim] per layer."""
    shape = (NUM_BLOCKS, heads, BLOCK_SIZE, 2 * HEAD_DIM)
    return {f"model.layers.{i}.attn": torch.zeros(shape, dtype=torch.float16) for i in range(LAYERS)}


class Engines:
    """Two backends (P, D) of one kind, opened through the registry, KV memory registered once.

    Destroying a Mooncake TransferEngine takes about a second, so tests share these and refill
    the KV tensors in place instead of opening backends per test. D also has a second, wider
    KV (other bytes per block) for the incompatible-layout test.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.p_kv = make_kv()
        self.d_kv = {HEADS: make_kv(), 2 * HEADS: make_kv(2 * HEADS)}
        extra = {"backend": name, "local_ip": HOST}
        self.p: TransferBackend = create_backend(parse_config("kv_producer", extra))
        self.d: TransferBackend = create_backend(parse_config("kv_consumer", extra))
        self.p.register(memory_ranges(self.p_kv))
        for kv in self.d_kv.values():
            self.d.register(memory_ranges(kv))

    def close(self) -> None:
        self.p.close()
        self.d.close()


BOTH_BACKENDS = pytest.mark.parametrize("backend_name", ["inproc", "mooncake"])


@dataclass
class Side:
    mgr: KVTransferManager
    kv: dict[str, torch.Tensor]
    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed: dict[str, list[int]] = field(default_factory=dict)

    def poll(self) -> None:
        sending, recving, failed = self.mgr.take_finished()
        assert not (set(failed) - recving), "a failed receive must also be reported as finished"
        assert not (self.sending & sending) and not (self.recving & recving), "reported twice"
        self.sending |= sending
        self.recving |= recving
        self.failed.update(failed)

    def wait_sent(self, req_id: str, timeout: float = 15.0) -> None:
        wait_for(lambda: self.poll() or req_id in self.sending, timeout, what=f"{req_id} in finished_sending")

    def wait_recv(self, req_id: str, timeout: float = 15.0) -> None:
        wait_for(lambda: self.poll() or req_id in self.recving, timeout, what=f"{req_id} in finished_recving")

    def stats(self) -> StatsSnapshot:
        return self.mgr.stats.snapshot()

    def room_state(self, room: int) -> RoomState | None:
        """P: the room's state; None when it is closed or was never seen."""
        assert self.mgr.prefill is not None
        with self.mgr.prefill._lock:
            entry = self.mgr.prefill._rooms.get(room)
        return None if entry is None else entry.state

    def idle(self) -> bool:
        """No live room (P) or load (D)."""
        m = self.mgr
        if m.prefill is not None:
            with m.prefill._lock:
                return not m.prefill._rooms
        assert m.decode is not None
        with m.decode._lock:
            return not m.decode._loads

    def settled(self) -> bool:
        """Idle, and nothing finished that vLLM was not told about yet."""
        reported = len(self.sending) + len(self.recving)
        self.poll()
        return self.idle() and len(self.sending) + len(self.recving) == reported


class Rig:
    """Managers around one bootstrap server and the shared engines; the fixtures stop every piece.

    Each test registers its own P rank (replacing the previous test's) and uses its own D
    manager, whose route cache is empty, so tests can share the server.
    """

    def __init__(self, server: BootstrapServer, engines: Engines) -> None:
        self.server = server
        self.bport = server.port
        self.engines = engines
        self.sides: dict[str, Side] = {}

    def make(
        self,
        mode: str,
        seed: int = 0,
        heads: int = HEADS,
        block_size: int = BLOCK_SIZE,
        register: bool = True,
        model: str = "",
        device: DeviceSync = NO_DEVICE,
        **extra: Any,
    ) -> Side:
        """A P (KV filled with random values from `seed`) or D (KV filled with -7) manager.

        ``device``: the rank's device seam (tests/support/sim_device.py simulates an asynchronous one)."""
        assert mode not in self.sides, "one manager per side and test (they share the KV memory)"
        extra.setdefault("kv_wait_timeout_s", 30.0)
        extra.setdefault("room_timeout_s", 30.0)
        extra.setdefault("bootstrap_port", self.bport)
        extra.setdefault("http_timeout_s", 2.0)
        extra.setdefault("backend", self.engines.name)
        cfg = parse_config("kv_producer" if mode == "prefill" else "kv_consumer", {"local_ip": HOST, **extra})
        if mode == "prefill":
            engine, kv = self.engines.p, self.engines.p_kv
            g = torch.Generator().manual_seed(seed)
            for t in kv.values():
                t.copy_(torch.randint(-2000, 2000, t.shape, generator=g))
        else:
            engine, kv = self.engines.d, self.engines.d_kv[heads]
            for t in kv.values():
                t.fill_(-7.0)
        spec = RankSpec(
            tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, block_size=block_size, kv_dtype=DTYPE, num_layers=LAYERS,
            model=model, num_blocks=NUM_BLOCKS,
        )  # fmt: skip
        mgr = KVTransferManager(cfg, spec, regions_of_kv_caches(kv, NUM_BLOCKS), engine, device=device)
        side = self.sides[mode] = Side(mgr, kv)
        if mode == "prefill" and register:
            info = RegisterRank(1, 0, 1, 0, HOST, mgr.rank_port, block_size, DTYPE, num_layers=LAYERS, model=model)
            assert register_rank(f"{HOST}:{self.bport}", info, retries=3, interval_s=0.05, timeout_s=5)
        return side

    def close(self) -> None:
        for side in self.sides.values():
            side.mgr.close()
            side.mgr.pool.shutdown(wait=True)  # no write may still be running into the shared KV


def start_bootstrap() -> BootstrapServer:
    server = BootstrapServer(BootstrapState(attn_tp_size=1, attn_dp_size=1), HOST, free_port())
    server.start()
    return server


def recv_job(rig: Rig, req_id: str, room: int, dst: list[int], start_block: int = 0, **kw: Any) -> RecvJob:
    return RecvJob(
        req_id=req_id,
        room=room,
        bootstrap_host=kw.pop("host", HOST),
        bootstrap_port=kw.pop("port", rig.bport),
        prefill_dp_rank=kw.pop("dp_rank", None),
        dst_block_ids=dst,
        start_block=start_block,
        num_tokens=kw.pop("num_tokens", BLOCK_SIZE * (start_block + len(dst))),
    )


def assert_landed(p: Side, d: Side, d_before: dict[str, torch.Tensor], src: list[int], dst: list[int]) -> None:
    """Each dst block equals its src block byte for byte; every other D block is unchanged."""
    for name in p.kv:
        assert torch.equal(d.kv[name][dst].view(torch.int16), p.kv[name][src].view(torch.int16)), name
        others = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert torch.equal(d.kv[name][others].view(torch.int16), d_before[name][others].view(torch.int16)), name


def snapshot(kv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in kv.items()}
