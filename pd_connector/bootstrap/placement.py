"""An instance's place in its deployment: its data-parallel rank and the bootstrap address it advertises.

P's scheduler names the bootstrap server in every finished prefill's ``kv_transfer_params`` and P's
ranks register there (``bootstrap.client``, ``bootstrap.dp_rooms``); both need to know which DP rank
this engine is and where D reaches the server.
"""

from __future__ import annotations

from typing import Any, Protocol


class PlacementSettings(Protocol):
    """The keys of ``DisaggConfig`` that place an instance in its deployment."""

    @property
    def dp_rank(self) -> int: ...

    @property
    def local_ip(self) -> str: ...

    @property
    def bootstrap_host(self) -> str: ...

    @property
    def start_bootstrap_server(self) -> bool: ...


def dp_rank_of(cfg: PlacementSettings, parallel_config: Any) -> int:
    """This instance's DP rank: ``dp_rank`` if set, else vLLM's (its DP index for independent engines).

    vLLM runs a dense model's DP ranks as independent engines (``data_parallel_rank`` 0 of size 1);
    ``ParallelConfig.data_parallel_index`` keeps the original rank (vLLM 0.23 and 0.32 alike).
    """
    if cfg.dp_rank >= 0:
        return cfg.dp_rank
    return int(getattr(parallel_config, "data_parallel_index", parallel_config.data_parallel_rank))


def advertised_bootstrap_host(cfg: PlacementSettings, dp_rank: int) -> str:
    """Where D reaches this prefill deployment's bootstrap server, as P's answer tells it.

    The instance that hosts the server (DP rank 0 with ``start_bootstrap_server``) binds it on
    its ``local_ip``; every other one registers at ``bootstrap_host``.
    """
    return cfg.local_ip if dp_rank == 0 and cfg.start_bootstrap_server else cfg.bootstrap_host
