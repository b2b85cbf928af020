"""The ``PeerHello`` a D rank sends each P rank once, before its first request there: how D's KV looks."""

from __future__ import annotations

from collections.abc import Sequence

from pd_connector import messages as proto
from pd_connector.layouts.regions import Region
from pd_connector.transfer.context import RankSpec


def hello_of(
    spec: RankSpec, regions: Sequence[Region], peer_id: str, descriptor: bytes, endpoint: str
) -> proto.PeerHello:
    """This D rank's introduction: its transfer descriptor, ZMQ endpoint, TP place and KV layout."""
    return proto.PeerHello(
        peer_id=peer_id,
        transfer_descriptor=descriptor,
        endpoint=endpoint,
        tp_rank=spec.tp_rank,
        tp_size=spec.tp_size,
        block_size=spec.block_size,
        kv_dtype=spec.kv_dtype,
        num_layers=spec.num_layers,
        regions=[r.as_tuple() for r in regions],
        total_kv_heads=spec.total_kv_heads,
        local_kv_heads=spec.local_kv_heads,
        use_mla=spec.use_mla,
        heads_outermost=spec.heads_outermost,
        token_major=spec.token_major,
        region_groups=list(spec.region_groups),
        num_blocks=spec.num_blocks,
        region_layers=list(spec.region_layers),
        wire_version=proto.WIRE_VERSION,
    )
