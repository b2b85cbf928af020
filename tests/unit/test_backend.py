"""Transfer backends: the registry, the batched-write helper, Mooncake's retries, the in-process backend."""

from __future__ import annotations

import ctypes
import threading

import pytest

from pd_connector.config import DisaggConfig, parse_config
from pd_connector.transfer import null_backend
from pd_connector.transfer.backend import (
    TransferBackend,
    TransferError,
    WriteStopped,
    describe,
    write_in_batches,
    write_pipelined,
)
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


def test_the_null_backend_is_known_only_once_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployment cannot pick ``backend: null`` (no byte would move); a benchmark enables it by name."""
    from pd_connector.transfer import registry

    monkeypatch.setattr(registry, "_REGISTERED", dict(registry._REGISTERED))
    registry._REGISTERED.pop(null_backend.NAME, None)
    assert null_backend.NAME not in known_backends()
    with pytest.raises(Exception, match="unknown transfer backend 'null'"):
        parse_config("kv_producer", {"backend": "null"})
    null_backend.enable()
    cfg = parse_config("kv_producer", {"backend": "null"})
    p, d = create_backend(cfg), create_backend(cfg)
    assert isinstance(p, null_backend.NullBackend) and isinstance(p, TransferBackend)
    p.write(d.descriptor, range(2500), range(2500), [8] * 2500, cfg.max_batch_entries)
    assert (p.batches, p.entries) == (3, 2500)
    with pytest.raises(TransferError, match="not a null backend"):
        p.write(b"10.0.0.3:15000", [1], [2], [8], 4)
    with pytest.raises(ValueError, match="built in"):
        registry.register_spec("mooncake", null_backend.BACKEND)


def test_describe_descriptors() -> None:
    assert describe(b"10.0.0.3:15000") == "10.0.0.3:15000"
    assert describe(b"\x00\xff") == "00ff"
    assert describe(b"a\nb") == "610a62"


# ------------------------------------------------------ batches and retries


class _FlakyEngine:
    """Stands in for mooncake's TransferEngine: fails the first `failures` batch writes (synchronous or
    asynchronous: an asynchronous one fails when its status is asked); `refused` asynchronous submissions
    are refused (batch id 0)."""

    def __init__(self, failures: int, refused: int = 0) -> None:
        self.failures = failures
        self.refused = refused
        self.calls: list[tuple[str, list[int], list[int], list[int]]] = []
        self.sync_calls = 0
        self.in_flight: dict[int, int] = {}  # batch id -> its status once asked
        self.most_in_flight = 0
        self._ids = iter(range(1, 1 << 30))

    def _status(self) -> int:
        if self.failures > 0:
            self.failures -= 1
            return -1
        return 0

    def batch_transfer_sync_write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        self.calls.append((session, src, dst, lengths))
        self.sync_calls += 1
        return self._status()

    def batch_transfer_async_write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        if self.refused > 0:
            self.refused -= 1
            return 0
        self.calls.append((session, src, dst, lengths))
        batch_id = next(self._ids)
        self.in_flight[batch_id] = self._status()
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        return batch_id

    def get_batch_transfer_status(self, batch_ids: list[int]) -> int:
        return min(self.in_flight.pop(b) for b in batch_ids)


def test_mooncake_descriptor_is_its_session() -> None:
    backend = MooncakeBackend(_FlakyEngine(0), "10.0.0.3:15000")
    assert backend.descriptor == b"10.0.0.3:15000"
    assert isinstance(backend, TransferBackend)


def test_a_failed_batch_write_is_tried_once_more(pd_logs: pytest.LogCaptureFixture) -> None:
    fake = _FlakyEngine(failures=1)
    MooncakeBackend(fake, "p:1").write(b"h:1", [1, 2, 3], [4, 5, 6], [8, 8, 8], max_batch=2)
    # Both batches were in flight at once; batch [1, 2] failed and was repeated.
    assert [c[1] for c in fake.calls] == [[1, 2], [3], [1, 2]]
    assert {c[0] for c in fake.calls} == {"h:1"}
    assert fake.most_in_flight == 2 and not fake.in_flight
    assert "trying again" in pd_logs.text and "to h:1" in pd_logs.text
    one_at_a_time = _FlakyEngine(failures=1)
    MooncakeBackend(one_at_a_time, "p:1", depth=1).write(b"h:1", [1, 2, 3], [4, 5, 6], [8, 8, 8], max_batch=2)
    assert [c[1] for c in one_at_a_time.calls] == [[1, 2], [1, 2], [3]]


def test_a_refused_submission_is_written_synchronously() -> None:
    """Mooncake refuses an asynchronous batch (id 0) when it has no segment for the peer: the synchronous
    call, which drops a stale segment of a restarted peer, writes that batch instead."""
    fake = _FlakyEngine(failures=0, refused=1)
    MooncakeBackend(fake, "p:1").write(b"h:1", [1, 2, 3], [4, 5, 6], [8, 8, 8], max_batch=2)
    assert [c[1] for c in fake.calls] == [[1, 2], [3]]
    assert fake.sync_calls == 1


def test_pipeline_depth_and_bytes_bound_the_batches_in_flight() -> None:
    in_flight: list[int] = []
    most = [0, 0]

    class Pipe:
        def submit(self, s: list[int], d: list[int], n: list[int]) -> int:
            in_flight.append(sum(n))
            most[0], most[1] = max(most[0], len(in_flight)), max(most[1], sum(in_flight))
            return 0

        def wait(self, handle: int) -> int:
            in_flight.pop(0)
            return handle

    write_pipelined(Pipe(), range(40), range(40), [8] * 40, 2, None, what="w", peer="p", depth=3)
    assert most == [3, 48] and not in_flight
    most[:] = [0, 0]
    write_pipelined(Pipe(), range(40), range(40), [8] * 40, 2, None, what="w", peer="p", depth=8, max_bytes=40)
    assert most == [2, 32] and not in_flight  # a third batch would put 48 bytes in flight
    most[:] = [0, 0]
    write_pipelined(Pipe(), range(4), range(4), [64] * 4, 2, None, what="w", peer="p", depth=8, max_bytes=40)
    assert most == [1, 128]  # a batch larger than max_bytes goes alone


def test_a_stopped_or_failed_pipelined_write_waits_for_its_batches_in_flight() -> None:
    """write_pipelined never returns or raises while a submitted batch is still in flight."""
    waited: list[int] = []
    wanted = [True, True, True, False]

    class Pipe:
        def __init__(self, fail: int | None) -> None:
            self.fail, self.submitted = fail, 0

        def submit(self, s: list[int], d: list[int], n: list[int]) -> int:
            self.submitted += 1
            return s[0]

        def wait(self, handle: int) -> int:
            waited.append(handle)
            return -1 if handle == self.fail else 0

    pipe = Pipe(fail=None)
    with pytest.raises(WriteStopped, match="stopped after 6 of 10 entries"):
        write_pipelined(pipe, range(10), range(10), [8] * 10, 2, lambda: wanted.pop(0), what="w", peer="p", depth=4)
    assert pipe.submitted == 3 and sorted(waited) == [0, 2, 4]
    waited.clear()
    pipe = Pipe(fail=0)
    with pytest.raises(TransferError, match="w of 2 entries to p failed with -1"):
        write_pipelined(pipe, range(10), range(10), [8] * 10, 2, None, what="w", peer="p", depth=2, retries=0)
    assert waited == [0, 2]  # batch 0 failed; batch 2, already in flight, was waited for before raising


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


def test_entries_in_flight_per_peer_stay_within_the_tcp_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake's TCP transport fails entries past its queue per peer: all writes of a backend together
    keep at most MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER in flight, in batches of a depth-th of it."""
    monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "64")
    lock = threading.Lock()
    in_flight: dict[int, int] = {}
    seen = {"most": 0, "entries": 0, "sizes": set()}

    class Engine:
        def batch_transfer_async_write(self, session: str, src: list[int], dst: list[int], n: list[int]) -> int:
            with lock:
                batch_id = len(in_flight) + 1000 * (seen["entries"] + 1)
                in_flight[batch_id] = len(src)
                seen["most"] = max(seen["most"], sum(in_flight.values()))
                seen["entries"] += len(src)
                seen["sizes"].add(len(src))
            return batch_id

        def get_batch_transfer_status(self, batch_ids: list[int]) -> int:
            threading.Event().wait(0.001)  # the batch moves
            with lock:
                in_flight.pop(batch_ids[0])
            return 0

    backend = MooncakeBackend(Engine(), "p:1")
    assert backend.credits.limit == 64
    writers = [
        threading.Thread(target=backend.write, args=(b"h:1", range(1000), range(1000), [8] * 1000, 1024))
        for _ in range(3)
    ]
    for t in writers:
        t.start()
    for t in writers:
        t.join(30)
    assert seen["entries"] == 3000 and 0 < seen["most"] <= 64
    assert seen["sizes"] <= {16, 1000 % 16} and not in_flight and backend.credits.in_flight("h:1") == 0


def test_the_reader_is_asked_after_the_wait_for_room_in_the_queue() -> None:
    """A batch that waited for room (other writes to the peer filled its queue) starts only if the reader
    still wants it then; its room goes back unused otherwise."""
    gave_up = threading.Event()
    log: list[str] = []

    class Pipe:
        def reserve(self, entries: int) -> None:
            log.append(f"reserve {entries}")
            gave_up.set()  # D gave up while this write waited for room

        def release(self, entries: int) -> None:
            log.append(f"release {entries}")

        def submit(self, s: list[int], d: list[int], n: list[int]) -> int:
            log.append("submit")
            return 0

        def wait(self, handle: int) -> int:
            return handle

    with pytest.raises(WriteStopped, match="stopped after 0 of 3 entries"):
        write_pipelined(Pipe(), [1, 2, 3], [4, 5, 6], [8] * 3, 4, lambda: not gave_up.is_set(), what="w", peer="p")
    assert log == ["reserve 3", "release 3"]
