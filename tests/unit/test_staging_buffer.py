"""The NHD staging buffer (transfer.staging) is allocated and registered with the KV.

- its start and size are 2 MiB-aligned, it lives on the KV's device;
- only a prefill rank with token-major KV where mixed TP may occur gets one (the module's rule);
- the worker registers it in the one ``register`` call of KV registration, on the registering
  thread, and a transfer registers nothing more;
- it counts against the transport's region limit: over it the rank refuses to start, naming the limit;
- mixed TP on NHD stays byte-exact through it (the rig of test_nhd_mixed_tp, in-process backends
  that refuse a write whose source is not registered memory).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pd_connector import worker as worker_mod
from pd_connector.config import parse_config
from pd_connector.layouts.regions import memory_ranges
from pd_connector.rank_checks import RankSetupError
from pd_connector.transfer.registry import register_backend
from pd_connector.transfer.staging import STAGING_ALIGN, aligned_buffer, nhd_reshuffle, round_up
from pd_connector.worker import PDWorker
from tests.support.ascend_kv import ascend_tensor
from tests.support.inproc_backend import InprocBackend
from tests.support.loopback import HOST, free_port
from tests.support.nhd_mixed_tp import CountingBackend, Engines, run_mixed_tp_case

MiB2 = 2 << 20
NB, BS, HEADS, HD, LAYERS = 6, 16, 4, 8, 2


class SpyBackend(InprocBackend):
    """The in-process backend, recording every ``register`` call and the thread that made it."""

    made: list[SpyBackend] = []

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[tuple[int, int]]] = []
        self.threads: list[str] = []
        SpyBackend.made.append(self)

    def register(self, ranges: Any) -> None:
        self.calls.append(list(ranges))
        self.threads.append(threading.current_thread().name)
        super().register(ranges)


@pytest.fixture
def spy() -> Iterator[type[SpyBackend]]:
    SpyBackend.made.clear()
    register_backend("inproc-spy-staging", lambda cfg: SpyBackend())
    yield SpyBackend
    SpyBackend.made.clear()


def nhd_kv(layers: int = LAYERS, heads: int = HEADS) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """vLLM-Ascend's KV: (k, v) per layer, [num_blocks, block_size, heads, head_dim], 2 MiB-aligned slices."""
    shape = (NB, BS, heads, HD)
    return {
        f"model.layers.{i}.self_attn.attn": (ascend_tensor(shape, torch.float16), ascend_tensor(shape, torch.float16))
        for i in range(layers)
    }


def vllm_config(heads: int = HEADS, layers: int = LAYERS) -> SimpleNamespace:
    """The parts of vLLM's config a PDWorker reads."""
    model = SimpleNamespace(
        use_mla=False, dtype=torch.float16, architectures=["Toy"], hf_text_config=SimpleNamespace(num_hidden_layers=layers),
        get_total_num_kv_heads=lambda: heads, get_hidden_size=lambda: heads * HD, get_vocab_size=lambda: 100,
        get_head_size=lambda: HD,
    )  # fmt: skip
    return SimpleNamespace(
        model_config=model,
        cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto", num_gpu_blocks=NB),
        parallel_config=SimpleNamespace(data_parallel_index=0, data_parallel_rank=0, data_parallel_size=1),
        observability_config=SimpleNamespace(otlp_traces_endpoint=None),
        kv_transfer_config=SimpleNamespace(kv_port=14579),  # vLLM's default: a random ZMQ port
    )


def prefill_worker(monkeypatch: pytest.MonkeyPatch, tp_size: int = 1, **extra: Any) -> PDWorker:
    monkeypatch.setattr(worker_mod, "_tp_rank_and_size", lambda: (0, tp_size))
    keys = {"local_ip": HOST, "bootstrap_port": free_port(), "backend": "inproc-spy-staging", **extra}
    cfg = parse_config("kv_producer", {"register_retries": 5, "register_interval_s": 0.1, **keys})
    return PDWorker(cfg, vllm_config(), None)  # type: ignore[arg-type]


# ------------------------------------------------------------------ alignment


@pytest.mark.parametrize("nbytes", [1, 868, MiB2 - 1, MiB2, MiB2 + 1, 64 << 20])
def test_aligned_buffer_start_and_size_are_2mib_aligned(nbytes: int) -> None:
    buf = aligned_buffer(nbytes, torch.device("cpu"))
    assert STAGING_ALIGN == MiB2
    assert buf.data_ptr() % MiB2 == 0
    assert buf.numel() == round_up(nbytes) and buf.numel() % MiB2 == 0 and buf.numel() >= nbytes
    assert buf.numel() - nbytes < MiB2  # rounded up, not more
    assert buf.dtype == torch.uint8 and buf.device.type == "cpu"
    buf.fill_(7)  # the whole aligned range is ours
    assert buf.untyped_storage().nbytes() == buf.numel() + MiB2  # 2 MiB of slack, kept alive by the slice


# ------------------------------------------------------------------ the rule


@pytest.mark.parametrize(
    ("role", "extra", "outermost", "has_reshuffle", "has_buffer"),
    [
        ("kv_producer", {}, False, True, True),  # decode TP unknown: mixed TP may occur
        ("kv_producer", {"decode": {"tp_size": 2}}, False, True, True),
        ("kv_producer", {"decode": {"tp_size": 1}}, False, False, False),  # equal TP: never staged
        ("kv_producer", {"staging_bytes": 0}, False, False, False),
        ("kv_producer", {}, True, False, False),  # head-major KV: slices are byte ranges already
        ("kv_consumer", {}, False, True, False),  # D permutes with transient tensors
    ],
    ids=["P", "P-decode-tp2", "P-decode-tp1", "P-staging0", "P-head-major", "D"],
)
def test_which_rank_gets_a_staging_buffer(
    role: str, extra: dict, outermost: bool, has_reshuffle: bool, has_buffer: bool
) -> None:
    cfg = parse_config(role, {"staging_bytes": 5000, **extra})
    kv = nhd_kv()
    got = nhd_reshuffle(cfg, kv, NB, BS, HEADS, use_mla=False, heads_outermost=outermost, tp_size=1)
    assert (got is not None) == has_reshuffle
    ranges = got.registered_ranges if got is not None else []
    assert bool(ranges) == has_buffer
    for addr, length in ranges:
        assert addr % MiB2 == 0 and length == MiB2  # 5000 bytes rounded up to 2 MiB
        assert got is not None and got._staging is not None and got._staging.device == kv_device(kv)
        assert got.staging_bytes == 5000  # batches stay within the configured bound


def kv_device(kv: dict) -> torch.device:
    return next(iter(kv.values()))[0].device


def test_mla_gets_no_staging_buffer() -> None:
    cfg = parse_config("kv_producer", {})
    assert nhd_reshuffle(cfg, nhd_kv(heads=1), NB, BS, 1, use_mla=True, heads_outermost=False, tp_size=1) is None


# ------------------------------------------------------------------ registration


def test_worker_registers_the_staging_buffer_once_with_the_kv(
    monkeypatch: pytest.MonkeyPatch, spy: type[SpyBackend]
) -> None:
    kv = nhd_kv()
    w = prefill_worker(monkeypatch, staging_bytes=3 * MiB2 + 5)
    try:
        w.register_kv_caches(kv)
        (backend,) = spy.made
        assert len(backend.calls) == 1, backend.calls  # one call, at registration time ...
        assert backend.threads == [threading.current_thread().name]  # ... on the registering thread
        kv_ranges = memory_ranges(kv)
        (staging,) = backend.calls[0][len(kv_ranges) :]
        assert backend.calls[0][: len(kv_ranges)] == kv_ranges
        addr, length = staging
        assert addr % MiB2 == 0 and length == 4 * MiB2
        assert w.manager is not None and w.manager.spec.token_major
        reshuffle = w.manager.prefill._ctx.reshuffle  # type: ignore[union-attr]
        assert reshuffle is not None and reshuffle.registered_ranges == [staging]
        assert reshuffle._staging.device == kv_device(kv)
    finally:
        w.shutdown()


def test_equal_decode_tp_registers_no_staging_buffer(monkeypatch: pytest.MonkeyPatch, spy: type[SpyBackend]) -> None:
    kv = nhd_kv()
    w = prefill_worker(monkeypatch, decode={"tp_size": 1})
    try:
        w.register_kv_caches(kv)
        (backend,) = spy.made
        assert backend.calls == [memory_ranges(kv)]
        assert w.manager is not None and not w.manager.spec.token_major  # D needing a reshuffle is refused
    finally:
        w.shutdown()


def strided_kv(layers: int) -> dict[str, torch.Tensor]:
    """``layers`` token-major KV tensors of one buffer, with gaps: one registered region each."""
    raw = torch.zeros(layers, 2, NB * BS * HEADS * HD, dtype=torch.float16)
    return {f"model.layers.{i}.self_attn.attn": raw[i, 0].view(NB, BS, HEADS, HD) for i in range(layers)}


def test_staging_buffer_counts_against_the_region_limit(monkeypatch: pytest.MonkeyPatch, spy: type[SpyBackend]) -> None:
    kv = strided_kv(256)  # the ascend transport's limit (REGION_LIMITS) is 256
    assert len(memory_ranges(kv)) == 256
    # A worker on the ascend transport writes vLLM-Ascend's variables into the environment: a copy here.
    monkeypatch.setattr(os, "environ", os.environ.copy())
    w = prefill_worker(monkeypatch, protocol="ascend")
    with pytest.raises(RankSetupError) as err:
        w.register_kv_caches(kv)
    msg = str(err.value)
    assert "257 memory regions" in msg and "256 of KV and 1 NHD staging buffer" in msg
    assert "'ascend' transport takes at most 256" in msg and "staging_bytes" in msg
    assert spy.made == []  # refused before a backend was opened: nothing registered
    w.shutdown()
    # Without the buffer (decode.tp_size equal: no mixed TP) the same KV fits.
    w = prefill_worker(monkeypatch, protocol="ascend", decode={"tp_size": 1})
    try:
        w.register_kv_caches(kv)
        assert [len(c) for c in spy.made[0].calls] == [256]
    finally:
        w.shutdown()


# ------------------------------------------------------------------ transfer


class InprocEngines(Engines):
    """The rig's backends, in process: a write from memory that is not registered fails."""

    def get(self, side: str, n: int) -> list[CountingBackend]:
        pool = self.p if side == "p" else self.d
        while len(pool) < n:
            pool.append(CountingBackend(SpyBackend()))
        for b in pool:
            b.lengths.clear()
        return pool[:n]


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), [(1, 2, 4), (2, 1, 4)], ids=["P1D2-stages", "P2D1-permutes"])
def test_mixed_tp_nhd_through_the_registered_buffer_is_byte_exact(
    spy: type[SpyBackend], p_tp: int, d_tp: int, heads: int
) -> None:
    engines = InprocEngines()
    try:
        run_mixed_tp_case(engines, p_tp, d_tp, heads)  # asserts byte-exact D blocks and whole-slice entries
        for b in engines.p + engines.d:
            inner = b.inner
            assert isinstance(inner, SpyBackend)
            assert len(inner.calls) == 1, inner.calls  # the transfer registered nothing more
        for b in engines.p:
            assert isinstance(b.inner, SpyBackend)
            *_, (addr, length) = b.inner.calls[0]
            assert addr % MiB2 == 0 and length == MiB2  # P's staging buffer, registered with its KV
    finally:
        for b in engines.p + engines.d:
            b.close()
