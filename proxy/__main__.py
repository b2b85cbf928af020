"""``python -m proxy``: run the PDConnector Router."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Sequence

from proxy.access.admin_token import ensure_admin_token, remove_token_file
from proxy.access.api_keys import startup_notes
from proxy.access.tls import server_context
from proxy.app import HOT_ROUTES_KEY, SHUTDOWN_TIMEOUT_S, create_app
from proxy.cli import parse_config
from proxy.router_config import RouterConfig
from proxy.server.hot_server import ServerLimits, serve
from proxy.server.log_lines import LoopFlushingHandler
from proxy.server.workers import fork_workers

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class LineFormatter(logging.Formatter):
    """``LOG_FORMAT``, with the date and time formatted once per second instead of once per line
    (two lines per request); a record with an exception or a stack goes through logging's own path."""

    def __init__(self) -> None:
        super().__init__(LOG_FORMAT)
        self._second = -1
        self._stamp = ""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info or record.exc_text or record.stack_info:
            return super().format(record)
        second = int(record.created)
        if second != self._second:
            self._second, self._stamp = second, time.strftime(self.default_time_format, self.converter(second))
        record.message = record.getMessage()
        return f"{self._stamp},{int(record.msecs):03d} {record.levelname} {record.name}: {record.message}"


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
    handler = LoopFlushingHandler(sys.stderr)
    handler.setFormatter(LineFormatter())
    logging.basicConfig(level=config.log_level, handlers=[handler])
    # One INFO line per request: skip what LOG_FORMAT never shows (caller lookup, thread/process names).
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    # aiohttp's own loggers: its access log is off; keep its error lines.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        config = ensure_admin_token(config)  # before the fork: every worker has the same one
    except OSError as exc:
        print(f"python -m proxy: error: cannot write the generated admin token: {exc}", file=sys.stderr)
        return 2
    owner = os.getpid()
    try:
        return _serve(config)
    finally:
        if os.getpid() == owner:  # the supervisor (or the only process), not a worker
            remove_token_file(config)


def _serve(config: RouterConfig) -> int:
    config = fork_workers(config)  # --workers N > 1: from here on in each worker (proxy/server/workers.py)
    app = create_app(config)
    log = logging.getLogger("proxy")
    scheme = "https" if config.tls else "http"
    log.info("Router listening on %s://%s:%d (%s)", scheme, config.host, config.port, config.describe())
    for level, note in startup_notes(config.access, config.host):
        log.log(level, "%s", note)
    served = serve(
        app,
        app[HOT_ROUTES_KEY],
        host=config.host,
        port=config.port,
        reuse_port=config.workers > 1,
        ssl_context=server_context(config.tls) if config.tls else None,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        limits=ServerLimits(config.header_timeout, config.body_timeout, config.write_timeout),
        max_body_size=config.max_body_size,
    )
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(served)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
