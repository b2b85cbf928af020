"""Transfer backends: the registry, the batched-write helper, Mooncake's retries, the in-process backend."""

from __future__ import annotations

import ctypes
import threading

import pytest

from pd_connector.config import DisaggConfig, parse_config
from pd_connector.transfer.backend import TransferBackend, TransferError, WriteStopped, describe, write_in_batches
from pd_connector.transfer.mooncake import MooncakeBackend
from pd_connector.transfer.registry import (
    UnknownBackendError,
    create_backend,
    known_backends,
    register_backend,
)
from pd_connector.transfer.stats import NAMES, TransferStats
from tests.support.inproc_backend import InprocBackend, register_inproc

# ---------------------------------------------------------------- registry


def test_registry_knows_mooncake_by_default() -> None:
    assert "mooncake" in known_backends()
    assert parse_config("kv_consumer", {}).backend == "mooncake"


def test_a_registered_backend_is_created_by_name() -> None:
    register_inproc()
    cfg = parse_config("kv_producer", {"backend": "inproc"})
    backend = create_backend(cfg)
    try:
        assert isinstance(backend, InprocBackend) and isinstance(backend, TransferBackend)
        assert backend.descriptor.startswith(b"device_copy:")  # the device_copy table, host copies
    finally:
        backend.close()


def test_factories_get_the_config() -> None:
    seen: list[DisaggConfig] = []

    def factory(cfg: DisaggConfig) -> InprocBackend:
        seen.append(cfg)
        return InprocBackend()

    register_backend("inproc-spy", factory)
    cfg = parse_config("kv_consumer", {"backend": "inproc-spy", "local_ip": "127.0.0.2"})
    create_backend(cfg).close()
    assert seen == [cfg]


def test_unknown_backend_names_it_and_the_known_ones() -> None:
    cfg = DisaggConfig(mode="decode", backend="nixl")  # not validated: straight to the registry
    with pytest.raises(UnknownBackendError, match=r"unknown transfer backend 'nixl'; known backends: \[.*'mooncake'"):
        create_backend(cfg)
    with pytest.raises(ValueError, match="non-empty name"):
        register_backend("", lambda cfg: InprocBackend())


def test_describe_descriptors() -> None:
    assert describe(b"10.0.0.3:15000") == "10.0.0.3:15000"
    assert describe(b"\x00\xff") == "00ff"
    assert describe(b"a\nb") == "610a62"


# ------------------------------------------------------ batches and retries


class _FlakyEngine:
    """Stands in for mooncake's TransferEngine: fails the first `failures` batch writes."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[tuple[str, list[int], list[int], list[int]]] = []

    def batch_transfer_sync_write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        self.calls.append((session, src, dst, lengths))
        if self.failures > 0:
            self.failures -= 1
            return -1
        return 0


def test_mooncake_descriptor_is_its_session() -> None:
    backend = MooncakeBackend(_FlakyEngine(0), "10.0.0.3:15000")
    assert backend.descriptor == b"10.0.0.3:15000"
    assert isinstance(backend, TransferBackend)


def test_a_failed_batch_write_is_tried_once_more(pd_logs: pytest.LogCaptureFixture) -> None:
    fake = _FlakyEngine(failures=1)
    MooncakeBackend(fake, "p:1").write(b"h:1", [1, 2, 3], [4, 5, 6], [8, 8, 8], max_batch=2)
    # Batch [1, 2] failed and was repeated; batch [3] went through at once.
    assert [c[1] for c in fake.calls] == [[1, 2], [1, 2], [3]]
    assert {c[0] for c in fake.calls} == {"h:1"}
    assert "trying again" in pd_logs.text and "to h:1" in pd_logs.text


def test_a_batch_write_that_fails_twice_raises() -> None:
    fake = _FlakyEngine(failures=2)
    with pytest.raises(TransferError, match="Mooncake batch write of 1 entries to h:1 failed with -1"):
        MooncakeBackend(fake, "p:1").write(b"h:1", [1], [2], [8], max_batch=4)
    assert len(fake.calls) == 2


def test_a_failed_write_is_not_repeated_once_the_reader_gave_up() -> None:
    fake = _FlakyEngine(failures=1)
    wanted = iter([True, False])  # wanted for the first batch, given up before the retry
    with pytest.raises(TransferError):
        MooncakeBackend(fake, "p:1").write(b"h:1", [1], [2], [8], max_batch=4, still_wanted=lambda: next(wanted))
    assert len(fake.calls) == 1


def test_no_batch_starts_once_the_reader_gave_up() -> None:
    """still_wanted() is asked before every batch: a cancel between two batches stops the write there."""
    calls: list[list[int]] = []
    wanted = [True, True, False]

    def write_batch(s: list[int], d: list[int], n: list[int]) -> int:
        calls.append(d)
        return 0

    with pytest.raises(WriteStopped, match="stopped after 4 of 6 entries"):
        write_in_batches(write_batch, range(6), range(6), [8] * 6, 2, lambda: wanted.pop(0), what="w", peer="p")
    assert calls == [[0, 1], [2, 3]]
    with pytest.raises(WriteStopped, match="stopped after 0 of 1 entries"):  # nothing at all once given up
        MooncakeBackend(_FlakyEngine(failures=0), "p:1").write(b"h:1", [1], [2], [8], 4, still_wanted=lambda: False)


def test_write_in_batches_without_entries_writes_nothing() -> None:
    calls: list[object] = []
    write_in_batches(lambda *b: calls.append(b) or 0, [], [], [], 4, None, what="w", peer="p")
    assert calls == []


# ------------------------------------------------------------ in-process


def test_inproc_moves_bytes_and_refuses_foreign_memory() -> None:
    src, dst, other = (
        ctypes.create_string_buffer(b"abcdefgh", 8),
        ctypes.create_string_buffer(8),
        ctypes.create_string_buffer(8),
    )
    a, b = InprocBackend(), InprocBackend()
    try:
        a.register([(ctypes.addressof(src), 8)])
        b.register([(ctypes.addressof(dst), 8)])
        a.write(b.descriptor, [ctypes.addressof(src) + 2], [ctypes.addressof(dst)], [4], max_batch=8)
        assert dst.raw[:4] == b"cdef"
        with pytest.raises(TransferError, match="failed with -1"):
            a.write(b.descriptor, [ctypes.addressof(src)], [ctypes.addressof(other)], [4], max_batch=8)
        with pytest.raises(TransferError, match="failed with -1"):
            a.write(b.descriptor, [ctypes.addressof(src) + 6], [ctypes.addressof(dst)], [4], max_batch=8)
        assert other.raw == b"\x00" * 8
    finally:
        a.close()
        b.close()
    with pytest.raises(TransferError, match="no device_copy backend"):
        a.write(b.descriptor, [], [], [], max_batch=8)


# ------------------------------------------------------------------ stats


def test_stats_count_from_many_threads() -> None:
    stats = TransferStats()

    def bump() -> None:
        for _ in range(2000):
            stats.inc("bytes_sent", 3)
            stats.inc("transfers_ok")

    threads = [threading.Thread(target=bump) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = stats.snapshot()
    assert snap.bytes_sent == 8 * 2000 * 3 and snap.transfers_ok == 8 * 2000
    assert snap.as_dict() == {name: getattr(snap, name) for name in NAMES}
    assert snap.recvs_failed == 0
    with pytest.raises(KeyError, match="unknown transfer stat 'bytes'"):
        stats.inc("bytes")  # type: ignore[arg-type]
