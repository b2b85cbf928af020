"""``python -m proxy``: run the PDConnector Router."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from aiohttp import web

from proxy.app import SHUTDOWN_TIMEOUT_S, create_app
from proxy.cli import parse_config

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop when it is installed (it is with vLLM), else asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, log the backends and serve until interrupted (SIGINT/SIGTERM)."""
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level, format=LOG_FORMAT, stream=sys.stderr)
    # aiohttp's own loggers: its access log is off; keep its error lines.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    app = create_app(config)
    logging.getLogger("proxy").info(
        "Router listening on http://%s:%d (%s)", config.host, config.port, config.describe()
    )
    web.run_app(
        app,
        host=config.host,
        port=config.port,
        access_log=None,
        print=None,
        handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        backlog=2048,
        loop=_new_loop(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
