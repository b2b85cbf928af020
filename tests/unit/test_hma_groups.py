"""pd_connector.layouts.kv_groups (pure) and the group fields of the wire format."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
import torch

from pd_connector import messages as proto
from pd_connector.layouts.kv_groups import (
    NULL_BLOCK,
    BlockTableError,
    GroupError,
    check_group_block_sizes,
    check_peer_groups,
    decode_group_blocks,
    group_entries,
    group_pairs,
    layer_groups,
    layer_kinds,
    real_blocks,
    received_bytes,
    recurrent_groups,
    recv_groups,
    region_groups,
    replay_needs_freed_block,
    send_groups,
    sliding_windows,
)
from pd_connector.layouts.regions import Region
from pd_connector.metadata import RecvJob, SendJob


def config(*groups: list[str], block_sizes: tuple[int, ...] = ()) -> SimpleNamespace:
    sizes = block_sizes or (16,) * len(groups)
    return SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(layer_names=names, kv_cache_spec=SimpleNamespace(block_size=b))
            for names, b in zip(groups, sizes, strict=True)
        ]
    )


def test_layers_map_to_their_group() -> None:
    cfg = config(["l0", "l2"], ["l1", "l3"])
    assert layer_groups(cfg, ["l0", "l1", "l2", "l3"]) == [0, 1, 0, 1]
    assert layer_groups(None, ["a", "b"]) == [0, 0]
    assert layer_groups(config(["a"]), ["a", "zzz"]) == [0, 0]  # one group: everything is group 0
    with pytest.raises(GroupError, match=r"\['l9'\] are in none of the 2 KV cache groups"):
        layer_groups(cfg, ["l0", "l9"])
    with pytest.raises(GroupError, match="l0 is in KV cache groups 0 and 1"):
        layer_groups(config(["l0"], ["l0", "l1"]), ["l0"])


def test_region_groups_follow_each_layers_parts() -> None:
    kv = {
        "l0": (torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)),  # (k, v): 2 regions
        "l1": torch.zeros(2, 4, 16, 2, 8),  # [2, blocks, ...]: K and V regions
        "l2": torch.zeros(4, 2, 16, 16),  # CPU layout: 1 region
    }
    assert region_groups(kv, config(["l0", "l2"], ["l1"]), 4) == (0, 0, 1, 1, 0)
    assert region_groups(kv, config(["l0", "l1", "l2"]), 4) == ()  # one group: no group lists


def test_group_block_sizes_must_agree() -> None:
    assert check_group_block_sizes([16, 16]) == 16
    with pytest.raises(GroupError, match=r"block sizes \[16, 32\].*--disable-hybrid-kv-cache-manager"):
        check_group_block_sizes([16, 32])


def test_group_pairs_skip_decode_nulls_and_refuse_freed_prefill_blocks() -> None:
    src = [[1, 2, 3, 4], [NULL_BLOCK, NULL_BLOCK, 5, 6]]
    assert group_pairs(src, [[8, 9, 10], [NULL_BLOCK, 11, 12]], 1) == [([2, 3, 4], [8, 9, 10]), ([5, 6], [11, 12])]
    with pytest.raises(BlockTableError, match="group 1: decode needs block 1, which prefill already freed"):
        group_pairs(src, [[7, 8], [NULL_BLOCK, 11]], 0)
    with pytest.raises(BlockTableError, match="group 0: decode asks for blocks 2..4 but prefill holds 4"):
        group_pairs(src, [[7, 8, 9], [0, 0, 0]], 2)
    with pytest.raises(GroupError, match="prefill has 2 KV cache groups, decode asks for 1"):
        group_pairs(src, [[7]], 0)
    # One group: the table moves as given (block 0 is an ordinary id there, as before groups).
    assert group_pairs([[0, 1]], [[2, 0]], 0) == [([0, 1], [2, 0])]


def test_group_entries_use_only_each_groups_regions() -> None:
    regions = [Region(1000 * i, 10, 10) for i in range(4)]
    dst = [Region(50_000 + 1000 * i, 10, 10) for i in range(4)]
    calls = []

    def entries(s, d, runs):  # noqa: ANN001
        calls.append(([r.base for r in s], runs))
        return [r.base for r in s], [r.base for r in d], [len(runs)] * len(s)

    out = group_entries((0, 1, 0, 1), regions, dst, [([1, 2], [5, 6]), ([], [])], entries)
    assert calls == [([0, 2000], [(1, 5, 2)])]  # group 1 has nothing to move: not called
    assert out == ([0, 2000], [50_000, 52_000], [1, 1])


def test_peer_groups_must_match() -> None:
    check_peer_groups((), (), 4)
    check_peer_groups((0, 0), (), 2)  # all group 0 is the same as no groups
    with pytest.raises(GroupError, match=r"prefill regions are in groups \[0, 1\], decode's in \[0, 0\]"):
        check_peer_groups((0, 1), (), 2)


def test_job_groups_and_failed_blocks() -> None:
    single = SendJob("r", 1, [3, 4], 32)
    assert send_groups(single) == [[3, 4]]
    grouped = RecvJob("r", 1, "h", 1, None, [7, 8], 0, 32, dst_group_block_ids=[[7, 8], [NULL_BLOCK, 9]])
    assert recv_groups(grouped) == [[7, 8], [NULL_BLOCK, 9]]
    assert real_blocks(recv_groups(grouped)) == [7, 8, 9]
    assert real_blocks([[0, 5]]) == [0, 5]
    assert decode_group_blocks(([1, 2, 3], [0, 4, 5]), 1, 3) == [[2, 3], [4, 5]]
    regions = [Region(0, 100, 100), Region(0, 100, 40)]
    assert received_bytes(regions, (0, 1), [[7, 8], [NULL_BLOCK, 9]]) == 2 * 100 + 1 * 40
    assert received_bytes(regions, (), [[7, 8]]) == 2 * 140


def test_wire_format_carries_groups_and_reads_messages_without_them() -> None:
    req = proto.TransferRequest(1, "r", "p", [7, 8], 0, "tcp://x:1", dst_groups=[[7, 8], [0, 9]])
    assert proto.decode(proto.encode(req)) == req
    assert recv_groups(req) == [[7, 8], [0, 9]]

    class OldRequest(msgspec.Struct, tag="xfer", frozen=True):  # a request from before groups
        room: int
        request_id: str
        peer_id: str
        dst_block_ids: list[int]
        start_block: int
        endpoint: str = ""

    old = proto.decode(msgspec.msgpack.encode(OldRequest(1, "r", "p", [7, 8], 0)))
    assert isinstance(old, proto.TransferRequest) and old.dst_groups == [] and recv_groups(old) == [[7, 8]]
    hello = proto.PeerHello("p", b"d", "tcp://x:1", 0, 1, 16, "float16", 2, [(0, 1, 1)], region_groups=[0, 1])
    assert proto.decode(proto.encode(hello)).region_groups == [0, 1]


def test_the_boundary_prompt_lengths_of_a_window_are_found() -> None:
    sliding = SimpleNamespace(block_size=32, sliding_window=48)
    full = SimpleNamespace(block_size=32)
    cfg = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=full), SimpleNamespace(kv_cache_spec=sliding)])
    assert sliding_windows(cfg) == [48]
    assert sliding_windows(SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=sliding)])) == []  # one group
    # L - 48 + 1 a multiple of 32: the last token's oldest key (L - 48) opens a block that was freed.
    assert [n for n in range(1, 200) if replay_needs_freed_block(n, [48], 32)] == [79, 111, 143, 175]
    assert replay_needs_freed_block(100, [48], 32) is None and replay_needs_freed_block(79, [], 32) is None


def test_recurrent_groups_are_vllm_specs_that_are_no_attention() -> None:
    """A MambaSpec group is recurrent state; attention specs and tests' stand-in specs are not."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    state = MambaSpec(block_size=16, shapes=((3, 64), (4, 8, 8)), dtypes=(torch.float32, torch.float32))
    groups = [KVCacheGroupSpec(["m.0", "m.2", "m.4"], state), KVCacheGroupSpec(["a.1"], full)]
    real = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    assert recurrent_groups(real) == [0]
    assert layer_kinds(real) == "MambaSpec (MAMBA2): 3 layers (m.0, m.2, ...); FullAttentionSpec: 1 layers (a.1)"
    assert recurrent_groups(config(["l0"], ["l1"])) == [] and recurrent_groups(None) == []
