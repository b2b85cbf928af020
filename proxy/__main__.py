"""``python -m proxy``: run the PDConnector Router."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import uvicorn

from proxy.app import create_app
from proxy.cli import parse_config

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags, log the backends and serve until interrupted."""
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level, format=LOG_FORMAT, stream=sys.stderr)
    # httpx logs every request at INFO without the room / request id; the Router logs its own.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(config.log_level)))
    app = create_app(config)
    logging.getLogger("proxy").info(
        "Router listening on http://%s:%d (%s)", config.host, config.port, config.describe()
    )
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level.lower(), access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
