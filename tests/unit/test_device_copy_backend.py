"""The device_copy backend: chosen by name in the config, it copies between two ranks' registered memory."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pd_connector.config import ConfigError, parse_config
from pd_connector.layouts.regions import memory_ranges
from pd_connector.rank_checks import RankSetupError, check_kv_memory
from pd_connector.transfer.backend import TransferBackend, TransferError, WriteStopped
from pd_connector.transfer.device_copy import DeviceCopyBackend, DeviceCopyOptions
from pd_connector.transfer.registry import create_backend, known_backends


def _pair() -> tuple[TransferBackend, TransferBackend]:
    p = create_backend(parse_config("kv_producer", {"backend": "device_copy"}))
    d = create_backend(parse_config("kv_consumer", {"backend": "device_copy"}))
    return p, d


def test_it_is_a_backend_by_name_without_option_keys() -> None:
    assert "device_copy" in known_backends()
    cfg = parse_config("kv_producer", {"backend": "device_copy", "max_batch_entries": 4096})
    assert cfg.backend_options == DeviceCopyOptions()
    with pytest.raises(ConfigError, match=r"protocol is an option of the \[.*'mooncake'.*not of backend 'device_copy'"):
        parse_config("kv_producer", {"backend": "device_copy", "protocol": "tcp"})


def test_bytes_move_between_two_registered_buffers() -> None:
    src = ctypes.create_string_buffer(b"0123456789abcdef", 16)
    dst = ctypes.create_string_buffer(16)
    p, d = _pair()
    try:
        assert isinstance(p, DeviceCopyBackend) and p.descriptor != d.descriptor
        p.register([(ctypes.addressof(src), 16)])
        d.register([(ctypes.addressof(dst), 16)])
        base_s, base_d = ctypes.addressof(src), ctypes.addressof(dst)
        # Three entries in batches of two: "0123" -> dst[8:12], "ab" -> dst[0:2], "f" -> dst[15].
        p.write(d.descriptor, [base_s, base_s + 10, base_s + 15], [base_d + 8, base_d, base_d + 15], [4, 2, 1], 2)
        assert dst.raw == b"ab" + b"\0" * 6 + b"0123" + b"\0" * 3 + b"f"
    finally:
        p.close()
        d.close()


def test_kv_tensors_land_block_for_block() -> None:
    p_kv = {"l0": torch.arange(64, dtype=torch.float16).view(4, 16)}
    d_kv = {"l0": torch.full((4, 16), -7.0, dtype=torch.float16)}
    p, d = _pair()
    try:
        p.register(memory_ranges(p_kv))
        d.register(memory_ranges(d_kv))
        row = 16 * 2  # bytes of one block
        src, dst = p_kv["l0"].data_ptr(), d_kv["l0"].data_ptr()
        p.write(d.descriptor, [src + 1 * row, src + 3 * row], [dst + 0 * row, dst + 2 * row], [row, row], 8)
        assert torch.equal(d_kv["l0"][0], p_kv["l0"][1]) and torch.equal(d_kv["l0"][2], p_kv["l0"][3])
        assert bool((d_kv["l0"][1] == -7).all()) and bool((d_kv["l0"][3] == -7).all())
    finally:
        p.close()
        d.close()


def test_memory_outside_the_registered_ranges_is_refused_and_untouched() -> None:
    src, dst, other = (ctypes.create_string_buffer(b"abcdefgh", 8), ctypes.create_string_buffer(8),
                       ctypes.create_string_buffer(8))  # fmt: skip
    p, d = _pair()
    try:
        p.register([(ctypes.addressof(src), 8)])
        d.register([(ctypes.addressof(dst), 8)])
        with pytest.raises(TransferError, match="device_copy of 1 entries .* failed with -1"):
            p.write(d.descriptor, [ctypes.addressof(src)], [ctypes.addressof(other)], [4], 8)
        with pytest.raises(TransferError, match="failed with -1"):  # runs past the end of the source
            p.write(d.descriptor, [ctypes.addressof(src) + 6], [ctypes.addressof(dst)], [4], 8)
        with pytest.raises(WriteStopped):  # the reader gave up: nothing copied
            p.write(d.descriptor, [ctypes.addressof(src)], [ctypes.addressof(dst)], [4], 8, lambda: False)
        assert other.raw == dst.raw == b"\0" * 8
    finally:
        p.close()
        d.close()
    with pytest.raises(TransferError, match="no device_copy backend"):
        p.write(d.descriptor, [], [], [], 8)


class _NpuTensor:
    class device:
        type = "npu"


def test_npu_memory_is_refused_at_start_up() -> None:
    cfg = parse_config("kv_producer", {"backend": "device_copy"})
    with pytest.raises(RankSetupError, match="device_copy backend copies host or CUDA memory.*'npu'"):
        check_kv_memory(cfg, {"l0": _NpuTensor()}, [(0, 1)])
    check_kv_memory(cfg, {"l0": torch.zeros(2)}, [(0, 1)] * 1000)  # CPU memory, no region limit
