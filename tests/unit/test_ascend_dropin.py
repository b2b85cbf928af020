"""vLLM-Ascend 0.23 drop-in: its extra-config keys, the platform's transport, KV memory
registered as vLLM-Ascend registers it (each tensor's own bytes, at most 256 regions on ascend),
kernel blocks, and the prefill sizes D checks against P's route.

KV tensors here are built exactly as vLLM-Ascend's model runner builds them with a KV transfer
config: per layer a (k, v) tuple, each an int8 buffer 2 MiB larger than needed, a 2 MiB-aligned
slice of it viewed as [num_blocks * k, block_size / k, kv_heads, head_dim].
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pd_connector.ascend import platform as platform_transport
from pd_connector.ascend.env import ENV_VAR, endpoint_file, setup_local_comm_res
from pd_connector.ascend.peer_sizes import SideSizes
from pd_connector.config import ConfigError, DisaggConfig, parse_config
from pd_connector.layouts.regions import LayoutError, block_dim, memory_ranges, regions_of_kv_caches, regions_of_tensor
from pd_connector.layouts.tp import is_head_major
from pd_connector.metadata import SendJob
from pd_connector.rank_checks import RankSetupError, check_kv_memory, check_sizes
from pd_connector.transfer.mooncake import MooncakeOptions, default_protocol
from tests.support.ascend_kv import ascend_kv, ascend_tensor
from tests.support.byte_copies import apply_writes, storages_of, whole_block_writes
from tests.support.transfer_rig import Rig, recv_job, snapshot

MiB2 = 2 << 20
NB, BS, HEADS, HD = 12, 16, 4, 8


# -------------------------------------------------------------- A: config keys


def test_vllm_ascend_extra_config_is_accepted() -> None:
    extra = {
        "prefill": {"dp_size": 2, "tp_size": 8},
        "decode": {"dp_size": 32, "tp_size": 1},
        "use_ascend_direct": True,
        "ascend_local_comm_res_path": "/etc/hixlep",
    }
    cfg = parse_config("kv_producer", extra)
    assert cfg.prefill == SideSizes(dp_size=2, tp_size=8)
    assert cfg.decode == SideSizes(dp_size=32, tp_size=1)
    assert cfg.backend_options == MooncakeOptions(
        protocol="ascend", use_ascend_direct=True, ascend_local_comm_res_path="/etc/hixlep"
    )
    assert cfg.dp_size == 2  # P's deployment DP size comes from prefill.dp_size
    assert parse_config("kv_consumer", extra).dp_size == -1  # D: dp_size is a P setting


def test_sizes_accept_numeric_strings_and_one_key() -> None:
    assert parse_config("kv_consumer", {"decode": {"tp_size": "2"}}).decode == SideSizes(tp_size=2)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"prefil": {"dp_size": 1}}, ["prefil", "known keys", "prefill", "ascend_local_comm_res_path"]),
        ({"prefill": {"dp_szie": 1}}, ["dp_szie", "prefill", "tp_size"]),
        ({"prefill": {"dp_size": 0}}, ["prefill.dp_size", ">= 1"]),
        ({"decode": {"tp_size": "x"}}, ["decode.tp_size", "integer"]),
        ({"decode": {"tp_size": True}}, ["decode.tp_size"]),
        ({"decode": [1, 1]}, ["decode", "object"]),
        ({"use_ascend_direct": "maybe"}, ["use_ascend_direct"]),
        ({"use_ascend_direct": True, "protocol": "tcp"}, ["use_ascend_direct", "'tcp'"]),
        ({"prefill": {"dp_size": 2}, "dp_size": 4}, ["dp_size is 4", "prefill.dp_size is 2"]),
        ({"ascend_local_comm_res_path": 5}, ["ascend_local_comm_res_path"]),
    ],
)
def test_bad_ascend_keys_are_refused_by_name(extra: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config("kv_producer", extra)
    for word in words:
        assert word in str(info.value)


def protocol_of(cfg: DisaggConfig) -> str:
    assert isinstance(cfg.backend_options, MooncakeOptions)
    return cfg.backend_options.protocol


def test_use_ascend_direct_false_keeps_the_platform_default() -> None:
    assert protocol_of(parse_config("kv_producer", {"use_ascend_direct": False})) == "tcp"


def test_protocol_defaults_to_the_platform_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    assert protocol_of(parse_config("kv_producer", {})) == "tcp"  # this CPU machine
    monkeypatch.setattr(platform_transport, "_platform_device_type", lambda: "npu")
    assert protocol_of(parse_config("kv_producer", {})) == "ascend"
    assert protocol_of(parse_config("kv_producer", {"protocol": "rdma"})) == "rdma"
    # No vLLM platform to ask: torch_npu's presence decides.
    monkeypatch.setattr(platform_transport, "_platform_device_type", lambda: None)
    monkeypatch.setattr(platform_transport.importlib.util, "find_spec", lambda name: object())
    assert platform_transport.on_npu() and default_protocol() == "ascend"


class _FakeNpuTensor:
    class device:
        type = "npu"


def test_tcp_cannot_reach_npu_memory() -> None:
    cfg = parse_config("kv_producer", {"protocol": "tcp"})
    with pytest.raises(RankSetupError, match=r"protocol 'tcp' cannot read KV cache memory on device 'npu'.*ascend"):
        check_kv_memory(cfg, {"l0": (_FakeNpuTensor(), _FakeNpuTensor())}, [(0, 1)])
    check_kv_memory(parse_config("kv_producer", {"protocol": "ascend"}), {"l0": (_FakeNpuTensor(),)}, [(0, 1)])
    check_kv_memory(cfg, ascend_kv(1), [(0, 1)])  # CPU memory: fine


@pytest.mark.parametrize(
    ("mode", "sizes", "tp", "vllm_dp", "words"),
    [
        ("kv_producer", {"prefill": {"tp_size": 8}}, 4, 1, ["prefill.tp_size is 8", "tp_size 4"]),
        ("kv_producer", {"prefill": {"dp_size": 2}}, 1, 4, ["prefill.dp_size is 2", "dp_size 4"]),
        ("kv_consumer", {"decode": {"tp_size": 1}}, 2, 1, ["decode.tp_size is 1", "tp_size 2"]),
        ("kv_consumer", {"decode": {"dp_size": 8}}, 1, 4, ["decode.dp_size is 8", "dp_size 4"]),
    ],
)
def test_own_side_sizes_must_match_the_rank(mode: str, sizes: dict, tp: int, vllm_dp: int, words: list[str]) -> None:
    cfg = parse_config(mode, sizes)
    with pytest.raises(RankSetupError) as info:
        check_sizes(cfg, tp, vllm_dp)
    for word in words:
        assert word in str(info.value)


def test_own_side_sizes_that_match_pass() -> None:
    check_sizes(parse_config("kv_producer", {"prefill": {"dp_size": 2, "tp_size": 4}}), 4, 1)  # independent DP
    check_sizes(parse_config("kv_producer", {"prefill": {"dp_size": 2, "tp_size": 4}}), 4, 2)
    check_sizes(parse_config("kv_consumer", {"decode": {"dp_size": 32, "tp_size": 1}}), 1, 1)
    check_sizes(parse_config("kv_consumer", {"prefill": {"tp_size": 8}}), 1, 1)  # D does not check P here


@pytest.mark.parametrize(
    ("sizes", "error"),
    [
        ({"prefill": {"dp_size": 1, "tp_size": 2}}, "prefill.tp_size is 2, but the prefill deployment at"),
        ({"prefill": {"dp_size": 3}}, "prefill.dp_size is 3, but the prefill deployment at"),
        ({"prefill": {"dp_size": 1, "tp_size": 1}, "decode": {"tp_size": 1}}, None),
    ],
)
def test_decode_checks_prefill_sizes_against_the_route(
    fresh_rig: Rig,
    pd_logs: pytest.LogCaptureFixture,
    sizes: dict,
    error: str | None,
) -> None:
    room = 810 + len(str(sizes))
    p = fresh_rig.make("prefill", seed=room)
    d = fresh_rig.make("decode", **sizes)
    before = snapshot(d.kv)
    p.mgr.add_sends([SendJob("p-req", room, [0, 1], 32)])
    d.mgr.add_recvs([recv_job(fresh_rig, "d-req", room, [2, 3])])
    d.wait_recv("d-req", timeout=10)
    if error is None:
        assert d.failed == {}
        for name in p.kv:
            assert torch.equal(d.kv[name][[2, 3]].view(torch.int16), p.kv[name][[0, 1]].view(torch.int16))
        return
    assert d.failed == {"d-req": [2, 3]}
    assert error in pd_logs.text and "has " in pd_logs.text
    assert all(torch.equal(d.kv[name], before[name]) for name in d.kv)


# ---------------------------------------------------- A: ascend_local_comm_res_path


def test_local_comm_res_is_read_for_this_ranks_npu(tmp_path: Path) -> None:
    (tmp_path / "ub_endpoint_npu_6.json").write_text(json.dumps({"eid": "0x6", "ports": [1, 2]}, indent=2))
    env = {"ASCEND_RT_VISIBLE_DEVICES": "4,6"}
    assert setup_local_comm_res(str(tmp_path), 1, env)
    assert env[ENV_VAR] == '{"eid":"0x6","ports":[1,2]}'
    assert not setup_local_comm_res(str(tmp_path), 1, env)  # already set: left alone
    assert not setup_local_comm_res("", 0, {})
    # ASCEND_RT_VISIBLE_DEVICES unset: the local_rank-th physical NPU id (test_ascend_settings has more)
    assert endpoint_file(str(tmp_path), 3, None, lambda: [0, 1, 2, 3]) == tmp_path / "ub_endpoint_npu_3.json"


def test_local_comm_res_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="ub_endpoint_npu_0.json.*ascend_local_comm_res_path"):
        setup_local_comm_res(str(tmp_path), 0, {}, lambda: [0])
    (tmp_path / "ub_endpoint_npu_0.json").write_text("{not json")
    with pytest.raises(ValueError, match="ub_endpoint_npu_0.json"):
        setup_local_comm_res(str(tmp_path), 0, {}, lambda: [0])
    with pytest.raises(ValueError, match="local rank 2"):
        setup_local_comm_res(str(tmp_path), 2, {"ASCEND_RT_VISIBLE_DEVICES": "0,1"})


# ------------------------------------------------------------- B: registration


def test_registration_is_each_tensors_own_bytes() -> None:
    kv = ascend_kv(3)
    ranges = memory_ranges(kv)
    tensors = [t for pair in kv.values() for t in pair]
    assert sorted(ranges) == sorted((t.data_ptr(), t.nbytes) for t in tensors)
    for t in tensors:
        storage = t.untyped_storage()
        assert storage.nbytes() == t.nbytes + MiB2  # the buffer around it is larger ...
        assert (storage.data_ptr(), storage.nbytes()) not in ranges  # ... and is not registered
        assert t.data_ptr() % MiB2 == 0


def test_adjacent_tensors_merge_into_one_range() -> None:
    buf = ascend_tensor((2, NB, BS, HEADS, HD), torch.bfloat16)
    kv = {"l0": (buf[0], buf[1])}
    assert memory_ranges(kv) == [(buf.data_ptr(), buf.nbytes)]


def test_region_count_is_checked_against_the_ascend_limit() -> None:
    fake = [(i * 4096, 1024) for i in range(257)]
    with pytest.raises(RankSetupError, match=r"257 memory regions.*'ascend' transport takes at most 256"):
        check_kv_memory(parse_config("kv_consumer", {"protocol": "ascend"}), {}, fake)
    check_kv_memory(parse_config("kv_consumer", {"protocol": "ascend"}), {}, fake[:256])
    staging = [(1 << 30, 2 << 20)]  # P's NHD staging buffer counts as one more region (transfer.staging)
    check_kv_memory(parse_config("kv_producer", {"protocol": "ascend"}), {}, fake[:255], staging)
    with pytest.raises(RankSetupError, match=r"257 memory regions registered \(256 of KV and 1 NHD staging"):
        check_kv_memory(parse_config("kv_producer", {"protocol": "ascend"}), {}, fake[:256], staging)
    check_kv_memory(parse_config("kv_producer", {"protocol": "ascend"}), {}, fake[:256])  # no staging buffer
    check_kv_memory(parse_config("kv_producer", {"protocol": "tcp"}), {}, fake)  # no limit on tcp


# ------------------------------------------------------------- D: kernel blocks


def test_block_dim_with_kernel_blocks() -> None:
    assert block_dim((NB, BS, HEADS, HD), NB) == (0, 1)
    assert block_dim((2, NB, BS, HEADS, HD), NB) == (1, 1)
    assert block_dim((NB * 4, BS // 4, HEADS, HD), NB) == (0, 4)
    assert block_dim((NB * 2, BS, HEADS, NB), NB) == (0, 2)  # a head size equal to num_blocks is no block dim
    with pytest.raises(LayoutError, match="num_blocks"):
        block_dim((NB + 1, BS, HEADS, HD), NB)


@pytest.mark.parametrize("kernel", [1, 2, 4])
def test_kernel_block_regions_cover_whole_blocks(kernel: int) -> None:
    kv = ascend_kv(2, kernel=kernel)
    regions = regions_of_kv_caches(kv, NB)
    block_bytes = BS * HEADS * HD * 2
    assert len(regions) == 4
    for (k, v), pair in zip(kv.values(), zip(regions[::2], regions[1::2], strict=True), strict=True):
        for t, region in zip((k, v), pair, strict=True):
            assert region.base == t.data_ptr()
            assert region.block_bytes == region.block_stride == block_bytes
    assert not is_head_major(tuple(kv["model.layers.0.self_attn.attn"][0].shape), NB, HEADS) or kernel == 1


def test_kernel_blocks_that_are_not_back_to_back_are_refused() -> None:
    t = torch.zeros(NB * 2, BS // 2, HEADS, HD * 2)[..., :HD]
    with pytest.raises(LayoutError, match="per-block part is not contiguous"):
        regions_of_tensor(t, NB)
    padded = torch.zeros(NB * 2, BS // 2 + 1, HEADS, HD)[:, : BS // 2]
    with pytest.raises(LayoutError, match="kernel blocks of a block are not contiguous"):
        regions_of_tensor(padded, NB)


@pytest.mark.parametrize(("p_kernel", "d_kernel"), [(2, 1), (1, 4), (4, 2)])
def test_transfer_between_kernel_block_layouts_is_byte_exact(p_kernel: int, d_kernel: int) -> None:
    src_kv = ascend_kv(2, kernel=p_kernel, seed=31)
    dst_kv = ascend_kv(2, kernel=d_kernel)
    src, dst = regions_of_kv_caches(src_kv, NB), regions_of_kv_caches(dst_kv, NB)
    src_ids, dst_ids = [0, 1, 2, 7], [5, 6, 7, 1]
    entries = whole_block_writes(src, dst, [(0, 5, 3), (7, 1, 1)])
    assert len(entries[0]) == 2 * len(src)  # one entry per run and region, kernel blocks or not
    apply_writes(entries, storages_of(dst_kv))
    for (sk, sv), (dk, dv) in zip(src_kv.values(), dst_kv.values(), strict=True):
        for s_t, d_t in ((sk, dk), (sv, dv)):
            logical_src = s_t.reshape(NB, BS, HEADS, HD)
            logical_dst = d_t.reshape(NB, BS, HEADS, HD)
            for s, d in zip(src_ids, dst_ids, strict=True):
                assert torch.equal(logical_dst[d], logical_src[s])
            untouched = [b for b in range(NB) if b not in dst_ids]
            assert int(logical_dst[untouched].abs().sum()) == 0
