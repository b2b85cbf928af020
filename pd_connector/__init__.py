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


def _setup_logging() -> None:
    """Give the `pd_connector` loggers a handler like vLLM's, once per process.

    vLLM configures only its own `vllm` logger; without this, our request lines
    (room, request id, transfer times) would be dropped. Level from
    PD_CONNECTOR_LOG_LEVEL (default INFO).
    """
    import logging
    import os

    log = logging.getLogger(__name__)
    if log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s [pd_connector.%(module)s] %(message)s", "%m-%d %H:%M:%S")
    )
    log.addHandler(handler)
    log.setLevel(os.environ.get("PD_CONNECTOR_LOG_LEVEL", "INFO").upper())
    log.propagate = False


_setup_logging()
