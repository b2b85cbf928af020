"""PDConnector: a vLLM KV connector for prefill/decode disaggregation.

vLLM loads `register()` through the `vllm.general_plugins` entry point in every
process it starts, so `--kv-transfer-config '{"kv_connector":"PDConnector",...}'`
works with no module path.
"""

from __future__ import annotations

CONNECTOR_NAME = "PDConnector"


def register() -> None:
    """Register PDConnector with vLLM's KVConnectorFactory (safe to call many times)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, "pd_connector.connector", CONNECTOR_NAME)
