"""bootstrap.placement: an instance's DP rank (its own setting first, else vLLM's) and the bootstrap host it advertises."""

from __future__ import annotations

from types import SimpleNamespace

from pd_connector.bootstrap.placement import advertised_bootstrap_host, dp_rank_of
from pd_connector.config import parse_config


def test_dp_rank_setting_wins_over_vllms() -> None:
    cfg = parse_config("kv_producer", {"dp_rank": 2, "dp_size": 4})
    assert dp_rank_of(cfg, SimpleNamespace(data_parallel_index=1, data_parallel_rank=0)) == 2


def test_dp_rank_from_vllms_index_of_an_independent_engine() -> None:
    cfg = parse_config("kv_producer", {})
    assert dp_rank_of(cfg, SimpleNamespace(data_parallel_index=3, data_parallel_rank=0)) == 3
    assert dp_rank_of(cfg, SimpleNamespace(data_parallel_rank=1)) == 1  # a config without the index


def test_only_the_server_host_advertises_its_local_ip() -> None:
    cfg = parse_config("kv_producer", {"local_ip": "127.0.0.2", "bootstrap_host": "127.0.0.3"})
    assert advertised_bootstrap_host(cfg, 0) == "127.0.0.2"
    assert advertised_bootstrap_host(cfg, 1) == "127.0.0.3"
