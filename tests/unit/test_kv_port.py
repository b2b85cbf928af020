"""vLLM's ``kv_transfer_config.kv_port``: each rank's ZMQ side channel at ``kv_port + rank offset``.

The offset follows vLLM-Ascend's Mooncake connectors (``vllm_ascend/distributed/mooncake_connector.py``):
``dp_rank * tp_size * pp_size + pp_rank * tp_size + tp_rank``. vLLM's default kv_port (14579) keeps the
random free port. A port that cannot be bound stops start-up naming kv_port, the port and the rank.
"""

from __future__ import annotations

import dataclasses
import itertools
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
from vllm.config import KVTransferConfig

from launch.ports import port_in_use
from pd_connector.config import ConfigError, parse_config
from pd_connector.transfer.backend import TransferBackend
from pd_connector.transfer.channel import Channel
from pd_connector.transfer.context import RankSpec, side_channel_port, user_kv_port
from pd_connector.transfer.liveness import PeerWatch
from pd_connector.transfer.manager import KVTransferManager
from pd_connector.transfer.stats import TransferStats
from tests.support.loopback import HOST, free_port

SPEC = RankSpec(tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, block_size=16, kv_dtype="float32", num_layers=2)


@pytest.mark.parametrize(
    ("dp_rank", "tp_rank", "tp_size", "pp_rank", "pp_size", "offset"),
    [
        (0, 0, 1, 0, 1, 0),
        (0, 3, 4, 0, 1, 3),
        (1, 0, 4, 0, 1, 4),
        (2, 1, 2, 0, 1, 5),
        (0, 1, 2, 1, 2, 3),  # second stage: after the first stage's TP ranks
        (1, 0, 2, 0, 2, 4),  # a DP rank spans tp_size * pp_size ports
        (1, 1, 2, 1, 2, 7),
    ],
)
def test_the_port_is_kv_port_plus_the_rank_offset(
    dp_rank: int, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, offset: int
) -> None:
    assert side_channel_port(36000, dp_rank, tp_rank, tp_size, pp_rank, pp_size) == 36000 + offset
    spec = dataclasses.replace(
        SPEC, kv_port=36000, dp_rank=dp_rank, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size
    )
    assert spec.zmq_port == 36000 + offset


def test_a_deployment_takes_one_contiguous_port_per_rank() -> None:
    dp, tp, pp = 3, 4, 2
    ports = [
        side_channel_port(30000, d, t, tp, p, pp) for d, t, p in itertools.product(range(dp), range(tp), range(pp))
    ]
    assert sorted(ports) == list(range(30000, 30000 + dp * tp * pp))


def test_only_a_kv_port_the_user_set_counts() -> None:
    assert user_kv_port(KVTransferConfig(kv_connector="PDConnector", kv_role="kv_producer")) is None  # 14579
    assert user_kv_port(KVTransferConfig(kv_connector="PDConnector", kv_role="kv_producer", kv_port=36000)) == 36000
    assert user_kv_port(SimpleNamespace(kv_port="20001")) == 20001  # vLLM-Ascend's guides write it as a string
    assert user_kv_port(SimpleNamespace()) is None
    assert SPEC.zmq_port is None  # no kv_port: a random free port
    with pytest.raises(ConfigError, match="kv_transfer_config.kv_port 'twenty' is not a port number"):
        user_kv_port(SimpleNamespace(kv_port="twenty"))
    with pytest.raises(ConfigError, match="kv_transfer_config.kv_port 70000 is not a port number"):
        user_kv_port(SimpleNamespace(kv_port=70000))


def _noop(*_: Any) -> None:
    return None


@pytest.fixture
def channels() -> Iterator[list[Channel]]:
    made: list[Channel] = []
    yield made
    for ch in made:
        ch.close()


def test_a_channel_listens_on_the_port_from_kv_port(channels: list[Channel]) -> None:
    spec = dataclasses.replace(SPEC, dp_rank=1, tp_rank=1, tp_size=2)  # offset 3
    port = free_port()
    spec = dataclasses.replace(spec, kv_port=port - 3)
    assert spec.zmq_port == port
    ch = Channel(HOST, TransferStats("t"), _noop, _noop, None, PeerWatch(5.0), spec.zmq_port, spec.zmq_port_origin)
    channels.append(ch)
    ch.start()
    assert (ch.port, ch.endpoint) == (port, f"tcp://{HOST}:{port}")
    assert port_in_use(HOST, port)


def test_a_port_in_use_stops_start_up_naming_kv_port_port_and_rank() -> None:
    port = free_port()
    spec = dataclasses.replace(SPEC, dp_rank=0, tp_rank=1, tp_size=2, kv_port=port - 1)
    cfg = parse_config("kv_producer", {"local_ip": HOST})
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind((HOST, port))
        holder.listen()
        with pytest.raises(ConfigError) as caught:
            # The bind fails before the manager touches its backend.
            KVTransferManager(cfg, spec, [], cast(TransferBackend, None))
    text = str(caught.value)
    assert f"port {port} (kv_transfer_config.kv_port {port - 1} + dp_rank 0 * tp_size 2" in text
    assert "+ tp_rank 1, rank dp0/tp1/pp0)" in text
    assert "choose another kv_transfer_config.kv_port" in text


def test_a_port_past_65535_is_refused_naming_it(channels: list[Channel]) -> None:
    spec = dataclasses.replace(SPEC, dp_rank=1, tp_size=8, kv_port=65530)
    with pytest.raises(ConfigError, match="port 65538 .*kv_port 65530.*not a TCP port"):
        Channel(HOST, TransferStats("t"), _noop, _noop, None, None, spec.zmq_port, spec.zmq_port_origin)
