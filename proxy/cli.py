"""Command line of ``python -m proxy`` (flag names follow vLLM-Ascend's example proxy)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import NoReturn

from proxy.config import Backend, RouterConfig

DEFAULT_BOOTSTRAP_PORT = 18800
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (no usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the Router."""
    parser = _OneLineErrorParser(
        prog="python -m proxy",
        description="PDConnector Router: sends each OpenAI completion/chat request to one prefill "
        "and one decode vLLM instance at once and returns the decode instance's answer.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--prefiller-hosts", nargs="+", metavar="HOST", help="hosts of the prefill instances")
    parser.add_argument(
        "--prefiller-ports", nargs="+", type=int, metavar="PORT", help="HTTP ports of the prefill instances"
    )
    parser.add_argument(
        "--prefiller-bootstrap-ports",
        nargs="+",
        type=int,
        metavar="PORT",
        help="bootstrap-server port of each prefill instance; one value applies to all "
        f"(default: {DEFAULT_BOOTSTRAP_PORT})",
    )
    parser.add_argument("--decoder-hosts", nargs="+", metavar="HOST", help="hosts of the decode instances")
    parser.add_argument(
        "--decoder-ports", nargs="+", type=int, metavar="PORT", help="HTTP ports of the decode instances"
    )
    parser.add_argument(
        "--max-retries",
        type=int,
        default=3,
        help="attempts per backend request when its connection cannot be opened (default: %(default)s)",
    )
    parser.add_argument(
        "--retry-delay",
        type=float,
        default=0.001,
        help="base delay in seconds of the exponential back-off between attempts (default: %(default)s)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="total seconds allowed for one backend request, streamed body included (default: %(default)s)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        help="seconds allowed to connect to a backend (default: %(default)s)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=LOG_LEVELS,
        help="log level (default: %(default)s)",
    )
    return parser


def _check_port(parser: argparse.ArgumentParser, flag: str, port: int) -> None:
    if not 1 <= port <= 65535:
        parser.error(f"{flag}: port {port} is not in 1..65535")


def _pair(
    parser: argparse.ArgumentParser, kind: str, hosts: list[str] | None, ports: list[int] | None
) -> list[tuple[str, int]]:
    if not hosts or not ports:
        parser.error(f"at least one {kind} is required: give --{kind}-hosts and --{kind}-ports")
    if len(hosts) != len(ports):
        parser.error(f"--{kind}-hosts has {len(hosts)} values but --{kind}-ports has {len(ports)}")
    for host in hosts:
        if not host.strip():
            parser.error(f"--{kind}-hosts: empty host name")
    for port in ports:
        _check_port(parser, f"--{kind}-ports", port)
    return list(zip(hosts, ports, strict=True))


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RouterConfig:
    """Validate parsed arguments and turn them into a :class:`RouterConfig` (errors exit with code 2)."""
    _check_port(parser, "--port", args.port)
    prefill_pairs = _pair(parser, "prefiller", args.prefiller_hosts, args.prefiller_ports)
    decode_pairs = _pair(parser, "decoder", args.decoder_hosts, args.decoder_ports)

    bootstrap_ports: list[int] = args.prefiller_bootstrap_ports or [DEFAULT_BOOTSTRAP_PORT]
    if len(bootstrap_ports) == 1:
        bootstrap_ports = bootstrap_ports * len(prefill_pairs)
    elif len(bootstrap_ports) != len(prefill_pairs):
        parser.error(
            f"--prefiller-bootstrap-ports has {len(bootstrap_ports)} values; give one, or one per "
            f"prefiller ({len(prefill_pairs)})"
        )
    for port in bootstrap_ports:
        _check_port(parser, "--prefiller-bootstrap-ports", port)

    if args.max_retries < 1:
        parser.error(f"--max-retries must be at least 1 (got {args.max_retries})")
    if not (math.isfinite(args.retry_delay) and args.retry_delay >= 0):
        parser.error(f"--retry-delay must be a finite number >= 0 (got {args.retry_delay})")
    for flag, value in (("--request-timeout", args.request_timeout), ("--connect-timeout", args.connect_timeout)):
        if not (math.isfinite(value) and value > 0):
            parser.error(f"{flag} must be a finite number > 0 (got {value})")

    prefillers = tuple(
        Backend("prefill", host, port, bootstrap)
        for (host, port), bootstrap in zip(prefill_pairs, bootstrap_ports, strict=True)
    )
    decoders = tuple(Backend("decode", host, port) for host, port in decode_pairs)
    return RouterConfig(
        prefillers=prefillers,
        decoders=decoders,
        host=args.host,
        port=args.port,
        max_retries=args.max_retries,
        retry_delay=args.retry_delay,
        request_timeout=args.request_timeout,
        connect_timeout=args.connect_timeout,
        health_timeout=min(2.0, args.connect_timeout),
        log_level=args.log_level,
    )


def parse_config(argv: Sequence[str] | None = None) -> RouterConfig:
    """Parse ``argv`` (default: ``sys.argv[1:]``) into a validated :class:`RouterConfig`."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    return config_from_args(args, parser)
