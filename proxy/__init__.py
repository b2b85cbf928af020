"""The PDConnector Router: an OpenAI-compatible reverse proxy for prefill/decode disaggregation.

Each completion or chat request is sent at the same time to one prefill instance (P), which
computes the prompt's KV cache and pushes it to the decode instance, and to one decode
instance (D), which waits for that KV cache and generates the answer. The Router returns
D's answer, retries a failed attempt on another P/D pair while nothing was sent yet, closes
both backend requests when the client goes away, and reports Prometheus metrics.

Run it with ``python -m proxy --prefiller-hosts ... --prefiller-ports ... --decoder-hosts ...
--decoder-ports ...``; see :mod:`proxy.cli` for the flags and :mod:`proxy.app` for the endpoints.
"""

from proxy.app import create_app
from proxy.router_config import Backend, RouterConfig

__all__ = ["Backend", "RouterConfig", "create_app"]
