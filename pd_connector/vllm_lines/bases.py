"""vLLM's KV-connector metadata base classes, with stand-ins where vLLM is not installed.

``pd_connector.metadata`` (the scheduler -> worker jobs) and ``pd_connector.d2rh.scheduler`` (the worker ->
scheduler D2RH report) subclass vLLM's ``KVConnectorMetadata`` and ``KVConnectorWorkerMetadata``
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``). Those two modules are also on the
transfer path itself (``transfer.manager``, ``host_kv``), which runs without vLLM: on a machine with
only torch and an accelerator (``scripts/device_check.py``) and in the benchmarks. There the import
fails and plain stand-ins take the classes' place; under vLLM the real classes are used, so vLLM's
``isinstance`` checks and the worker metadata's ``aggregate`` work as vLLM expects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["VLLM_BASES", "KVConnectorMetadata", "KVConnectorWorkerMetadata"]

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

    VLLM_BASES: bool
else:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

        VLLM_BASES = True  # vLLM's own classes
    except ImportError:  # no vLLM (or a stub without these names): the transfer path alone
        VLLM_BASES = False

        class KVConnectorMetadata:  # noqa: B903 - vLLM's is an empty ABC too
            """Stand-in for vLLM's scheduler -> worker metadata base (vLLM is not installed)."""

        class KVConnectorWorkerMetadata:
            """Stand-in for vLLM's worker -> scheduler metadata base (vLLM is not installed)."""

            def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
                return self
