"""Command line of ``python -m proxy`` (flag names follow vLLM-Ascend's example proxy)."""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from pd_connector.kv_params import DEFAULT_BOOTSTRAP_PORT
from proxy.access.flags import add_security_flags, security_from_args
from proxy.admin.rebalance_flags import add_rebalance_flags, rebalance_config_from_args
from proxy.both_flags import add_both_flags, both_from_args
from proxy.planning.flags import add_path_flags, path_config_from_args
from proxy.router_config import ROUTING_POLICIES, Backend, RouterConfig
from proxy.upstream.routing import RoutingOptions, describe

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


class _OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (no usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_size(text: str) -> int:
    """``"1048576"``, ``"512k"``, ``"32M"``, ``"1GiB"`` -> bytes (argparse type)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 1048576, 512k, 32M)")
    unit = (match.group(2) or "").lower()[:1]
    return int(match.group(1)) * _SIZE_UNITS[unit]


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the Router."""
    parser = _OneLineErrorParser(
        prog="python -m proxy",
        description="PDConnector Router: sends each OpenAI completion/chat request to one prefill "
        "and one decode vLLM instance at once and returns the decode instance's answer.",
    )
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    add("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    add("--prefiller-hosts", nargs="+", metavar="HOST", help="hosts of the prefill instances")
    add("--prefiller-ports", nargs="+", type=int, metavar="PORT", help="HTTP ports of the prefill instances")
    add(
        "--prefiller-bootstrap-ports",
        nargs="+",
        type=int,
        metavar="PORT",
        help="bootstrap-server port of each prefill instance; one value applies to all "
        f"(default: {DEFAULT_BOOTSTRAP_PORT})",
    )
    add(
        "--prefiller-bootstrap-hosts",
        nargs="+",
        metavar="HOST",
        help="host of each prefill instance's bootstrap server (its deployment's DP-rank-0 leader); one value "
        "applies to all (default: the prefiller's own host)",
    )
    add(
        "--prefiller-dp-ranks",
        nargs="+",
        type=int,
        metavar="RANK",
        help="DP rank of each prefill instance within its deployment (external DP: one API server per rank), "
        "sent to D as prefill_dp_rank; without it D asks the bootstrap server which rank holds each room",
    )
    add("--decoder-hosts", nargs="+", metavar="HOST", help="hosts of the decode instances")
    add("--decoder-ports", nargs="+", type=int, metavar="PORT", help="HTTP ports of the decode instances")
    add(
        "--decoder-bootstrap-ports",
        nargs="+",
        type=int,
        metavar="PORT",
        help="bootstrap-server port of each decode instance started with the connector's migration on; one value "
        "applies to all, 0 for a decoder without migration. A drain then moves their streams with their KV (D -> D push) instead of prefilling the "
        "tokens again (default: none, drains replay)",
    )
    add_both_flags(parser)
    policies = "; ".join(f"'{name}' = {describe(name)}" for name in ROUTING_POLICIES).replace("%", "%%")
    add(
        "--routing",
        choices=ROUTING_POLICIES,
        default=ROUTING_POLICIES[0],
        help=f"how P and D are chosen: {policies} (default: %(default)s)",
    )
    _add_cache_aware_flags(parser)
    add_path_flags(parser)
    add(
        "--max-retries",
        type=int,
        default=3,
        help="attempts per request in total; a failed attempt (backend unreachable or failing before any "
        "byte went to the client) is retried on another P/D pair with a fresh room (default: %(default)s)",
    )
    add(
        "--retry-delay",
        type=float,
        default=0.001,
        help="base delay in seconds of the exponential back-off between attempts (default: %(default)s)",
    )
    add(
        "--request-timeout",
        type=float,
        default=600.0,
        help="total seconds allowed for one request, all attempts and the streamed body included "
        "(default: %(default)s)",
    )
    add("--connect-timeout", type=float, default=5.0, help="seconds to connect to a backend (default: %(default)s)")
    add(
        "--health-interval",
        type=float,
        default=5.0,
        help="seconds between background health checks (GET /health) of every backend; 0 = off (default: %(default)s)",
    )
    add("--health-timeout", type=float, default=2.0, help="timeout of one health check (default: %(default)s)")
    add(
        "--max-body-size",
        type=parse_size,
        default=32 * 1024**2,
        metavar="BYTES",
        help="largest request body accepted, e.g. 1048576, 512k, 32M (default: 32M)",
    )
    add(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a client has to send a request's line and headers, from its first byte; then HTTP 408 "
        "and the connection closes (default: %(default)s)",
    )
    add(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds without a byte of a request body before HTTP 408 and close (default: %(default)s)",
    )
    add(
        "--write-timeout",
        type=float,
        default=30.0,
        help="seconds a client may read nothing of its answer (the send buffer full) before the connection "
        "and its backend requests are closed (default: %(default)s)",
    )
    add(
        "--max-waiting-retries",
        type=int,
        default=3,
        help="health checks an instance added at run time gets before it is dropped (default: %(default)s)",
    )
    add(
        "--waiting-retry-interval",
        type=float,
        default=10.0,
        help="seconds between those checks (default: %(default)s)",
    )
    add(
        "--workers",
        type=int,
        default=1,
        help="Router processes sharing the port (SO_REUSEPORT), each a whole Router on its own core; "
        "with more than 1, /instances/add|remove are refused (see proxy/server/workers.py) (default: %(default)s)",
    )
    add(
        "--trust-client-room",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="use the client's bootstrap_room (top level or in kv_transfer_params) instead of a random one; "
        "a room already in flight is refused with HTTP 409 (default: off, every request gets a random room)",
    )
    add(
        "--first-token-from-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stream P's own first token to the client as soon as P answers, then D's tokens (streamed "
        "/v1/completions whose sampling allows it; D gets P's prompt plus that token and computes it): TTFT "
        "is P's; --no-first-token-from-prefill: D answers from the first token on (default: on)",
    )
    add(
        "--max-recomputes",
        type=int,
        default=3,
        help="an answer a decoder cuts with stop_reason 'recomputed' (vLLM-Ascend's recompute_scheduler_enable) is "
        "continued on a fresh P/D pair, prompt plus the text so far, at most this many times per request; 0 passes "
        "it on as is (default: %(default)s)",
    )
    add(
        "--resume-attempts",
        type=int,
        default=2,
        help="a stream its decoder cuts after it started (connection lost, error event) is continued on another "
        "decoder (P prefills the prompt plus the tokens sent, D generates the rest): at most this many resumed legs "
        "per request; 0: the stream ends with an error event (default: %(default)s)",
    )
    add_rebalance_flags(parser)
    add_security_flags(parser)
    add("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="log level (default: %(default)s)")
    return parser


def _add_cache_aware_flags(parser: argparse.ArgumentParser) -> None:
    """The ``--cache-aware-*`` flags (``--routing cache-aware``; defaults: :class:`RoutingOptions`)."""
    default = RoutingOptions()
    add = parser.add_argument
    add(
        "--cache-aware-balance-abs",
        type=int,
        default=default.cache_aware_balance_abs,
        metavar="TOKENS",
        help="cache-aware: loads count as imbalanced (then P is the least-loaded one) when the busiest "
        "prefiller has more than this many in-flight prompt tokens over the idlest ... (default: %(default)s)",
    )
    add(
        "--cache-aware-balance-rel",
        type=float,
        default=default.cache_aware_balance_rel,
        metavar="RATIO",
        help="... and more than this many times the idlest's (default: %(default)s)",
    )
    add(
        "--cache-aware-min-match",
        type=float,
        default=default.cache_aware_min_match,
        metavar="FRACTION",
        help="cache-aware: a prompt whose best prefix match is below this fraction of it goes to the "
        "least-loaded prefiller (default: %(default)s)",
    )
    add(
        "--cache-aware-max-chars",
        type=parse_size,
        default=default.cache_aware_max_chars,
        metavar="CHARS",
        help="cache-aware: prompt characters remembered per prefiller (LRU beyond), e.g. 4M (default: 4M)",
    )


def _routing_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RoutingOptions:
    if args.cache_aware_balance_abs < 0:
        parser.error(f"--cache-aware-balance-abs must be >= 0 (got {args.cache_aware_balance_abs})")
    if not (math.isfinite(args.cache_aware_balance_rel) and args.cache_aware_balance_rel >= 1):
        parser.error(f"--cache-aware-balance-rel must be a finite number >= 1 (got {args.cache_aware_balance_rel})")
    if not 0 <= args.cache_aware_min_match <= 1:
        parser.error(f"--cache-aware-min-match must be in 0..1 (got {args.cache_aware_min_match})")
    if args.cache_aware_max_chars < 1:
        parser.error(f"--cache-aware-max-chars must be at least 1 (got {args.cache_aware_max_chars})")
    return RoutingOptions(
        cache_aware_balance_abs=args.cache_aware_balance_abs,
        cache_aware_balance_rel=args.cache_aware_balance_rel,
        cache_aware_min_match=args.cache_aware_min_match,
        cache_aware_max_chars=args.cache_aware_max_chars,
    )


def _check_port(parser: argparse.ArgumentParser, flag: str, port: int) -> None:
    if not 1 <= port <= 65535:
        parser.error(f"{flag}: port {port} is not in 1..65535")


def _positive(parser: argparse.ArgumentParser, flag: str, value: float, *, allow_zero: bool = False) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        parser.error(f"{flag} must be a finite number {'>= 0' if allow_zero else '> 0'} (got {value})")


def _pair(
    parser: argparse.ArgumentParser,
    kind: str,
    hosts: list[str] | None,
    ports: list[int] | None,
    *,
    optional: bool = False,
) -> list[tuple[str, int]]:
    if optional and not hosts and not ports:
        return []  # kv_both instances serve this role
    if not hosts or not ports:
        parser.error(f"at least one {kind} is required: give --{kind}-hosts and --{kind}-ports (or --both-hosts)")
    if len(hosts) != len(ports):
        parser.error(f"--{kind}-hosts has {len(hosts)} values but --{kind}-ports has {len(ports)}")
    for host in hosts:
        if not host.strip():
            parser.error(f"--{kind}-hosts: empty host name")
    for port in ports:
        _check_port(parser, f"--{kind}-ports", port)
    pairs = list(zip(hosts, ports, strict=True))
    if len(set(pairs)) != len(pairs):
        parser.error(f"--{kind}-hosts/--{kind}-ports: the same instance is listed twice")
    return pairs


def _one_or_each(
    parser: argparse.ArgumentParser,
    flag: str,
    values: list[Any] | None,
    count: int,
    default: Any = None,
    kind: str = "prefiller",
) -> list[Any]:
    """A per-instance list from ``values``: one value applies to all; ``default`` for all when absent."""
    if not values:
        return [default] * count
    if len(values) == 1:
        return values * count
    if len(values) != count:
        parser.error(f"{flag} has {len(values)} values; give one, or one per {kind} ({count})")
    return list(values)


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RouterConfig:
    """Validate parsed arguments and turn them into a :class:`RouterConfig` (errors exit with code 2)."""
    _check_port(parser, "--port", args.port)
    both = both_from_args(parser, args)
    prefill_pairs = _pair(parser, "prefiller", args.prefiller_hosts, args.prefiller_ports, optional=bool(both))
    decode_pairs = _pair(parser, "decoder", args.decoder_hosts, args.decoder_ports, optional=bool(both))
    listed = [*prefill_pairs, *decode_pairs]
    for backend in both:
        if (backend.host, backend.port) in listed:
            parser.error(f"--both-hosts/--both-ports: {backend.address} is also listed as a prefiller or decoder")

    count = len(prefill_pairs)
    bootstrap_ports = _one_or_each(
        parser, "--prefiller-bootstrap-ports", args.prefiller_bootstrap_ports, count, DEFAULT_BOOTSTRAP_PORT
    )
    for port in bootstrap_ports:
        _check_port(parser, "--prefiller-bootstrap-ports", port)
    bootstrap_hosts = _one_or_each(parser, "--prefiller-bootstrap-hosts", args.prefiller_bootstrap_hosts, count)
    if any(h is not None and not h.strip() for h in bootstrap_hosts):
        parser.error("--prefiller-bootstrap-hosts: empty host name")
    dp_ranks: list[int | None] = list(args.prefiller_dp_ranks or [None] * count)
    if len(dp_ranks) != count:
        parser.error(f"--prefiller-dp-ranks has {len(dp_ranks)} values; give one per prefiller ({count})")
    if any(r is not None and not 0 <= r < 65536 for r in dp_ranks):
        parser.error(f"--prefiller-dp-ranks: ranks must be in 0..65535 (got {dp_ranks})")
    seen: set[tuple[str, int, int]] = set()
    for (host, _), bhost, bport, rank in zip(prefill_pairs, bootstrap_hosts, bootstrap_ports, dp_ranks, strict=True):
        if rank is None:
            continue
        key = ((bhost or host).strip(), bport, rank)
        if key in seen:
            parser.error(f"--prefiller-dp-ranks: dp rank {rank} of bootstrap {key[0]}:{bport} is given twice")
        seen.add(key)

    if args.max_retries < 1:
        parser.error(f"--max-retries must be at least 1 (got {args.max_retries})")
    _positive(parser, "--retry-delay", args.retry_delay, allow_zero=True)
    _positive(parser, "--request-timeout", args.request_timeout)
    _positive(parser, "--connect-timeout", args.connect_timeout)
    _positive(parser, "--health-interval", args.health_interval, allow_zero=True)
    _positive(parser, "--health-timeout", args.health_timeout)
    for flag in ("--header-timeout", "--body-timeout", "--write-timeout"):
        _positive(parser, flag, getattr(args, flag[2:].replace("-", "_")))
    _positive(parser, "--waiting-retry-interval", args.waiting_retry_interval, allow_zero=True)
    if args.max_waiting_retries < 1:
        parser.error(f"--max-waiting-retries must be at least 1 (got {args.max_waiting_retries})")
    if args.max_body_size < 1:
        parser.error(f"--max-body-size must be at least 1 byte (got {args.max_body_size})")
    if args.resume_attempts < 0:
        parser.error(f"--resume-attempts must be at least 0 (got {args.resume_attempts})")
    if args.max_recomputes < 0:
        parser.error(f"--max-recomputes must be at least 0 (got {args.max_recomputes})")
    if not 1 <= args.workers <= 256:
        parser.error(f"--workers must be between 1 and 256 (got {args.workers})")

    prefillers = tuple(
        Backend("prefill", host, port, bootstrap, bhost.strip() if bhost else None, rank)
        for (host, port), bootstrap, bhost, rank in zip(
            prefill_pairs, bootstrap_ports, bootstrap_hosts, dp_ranks, strict=True
        )
    )
    decoder_bootstrap = _one_or_each(
        parser, "--decoder-bootstrap-ports", args.decoder_bootstrap_ports, len(decode_pairs), kind="decoder"
    )
    decoder_bootstrap = [None if port == 0 else port for port in decoder_bootstrap]  # 0: this one has none
    for port in decoder_bootstrap:
        if port is not None:
            _check_port(parser, "--decoder-bootstrap-ports", port)
    decoders = tuple(
        Backend("decode", host, port, bootstrap)
        for (host, port), bootstrap in zip(decode_pairs, decoder_bootstrap, strict=True)
    )
    # a kv_both instance is in both pools; its decode side is not movable by KV (kv_both refuses migration)
    prefillers += tuple(both)
    decoders += tuple(Backend("decode", b.host, b.port, both=True) for b in both)
    security = security_from_args(args, parser)
    return RouterConfig(
        prefillers=prefillers,
        decoders=decoders,
        host=args.host,
        port=args.port,
        max_retries=args.max_retries,
        retry_delay=args.retry_delay,
        request_timeout=args.request_timeout,
        connect_timeout=args.connect_timeout,
        routing=args.routing,
        routing_options=_routing_options(args, parser),
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        max_body_size=args.max_body_size,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        write_timeout=args.write_timeout,
        max_waiting_retries=args.max_waiting_retries,
        waiting_retry_interval=args.waiting_retry_interval,
        log_level=args.log_level,
        trust_client_room=args.trust_client_room,
        first_token_from_prefill=args.first_token_from_prefill,
        paths=path_config_from_args(args, parser),
        workers=args.workers,
        max_recomputes=args.max_recomputes,
        resume_attempts=args.resume_attempts,
        rebalance=rebalance_config_from_args(args, parser),
        backend_authorization=security.backend_authorization,
        access=security.access,
        tls=security.tls,
        backend_tls=security.backend_tls,
    )


def parse_config(argv: Sequence[str] | None = None) -> RouterConfig:
    """Parse ``argv`` (default: ``sys.argv[1:]``) into a validated :class:`RouterConfig`."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    return config_from_args(args, parser)
