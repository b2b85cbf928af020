"""Argument checks of the external-DP launcher (the vLLM-Ascend deployment guide's constraints).

Every violation raises `UsageError` with a one-line message; the CLI prints it and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import re
from collections.abc import Sequence

#: `vllm serve` flags that the launcher sets per rank; passing them after `--` is an error.
PER_RANK_FLAGS = (
    "--host",
    "--port",
    "--data-parallel-size",
    "-dp",
    "--data-parallel-rank",
    "-dpn",
    "--data-parallel-address",
    "-dpa",
    "--data-parallel-rpc-port",
    "-dpp",
    "--data-parallel-size-local",
    "-dpl",
    "--data-parallel-start-rank",
    "-dpr",
    "--data-parallel-hybrid-lb",
    "-dph",
    "--tensor-parallel-size",
    "-tp",
)
_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


class UsageError(Exception):
    """A flag value or a combination of flags that the launcher refuses (exit code 2)."""


def _valid_port(port: int) -> bool:
    return 1 <= port <= 65535


def _valid_address(addr: str) -> bool:
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(addr)
        return True
    return bool(_HOSTNAME_RE.match(addr))


def validate(args: argparse.Namespace, extra: Sequence[str], dp_mode: str = "vllm") -> int:
    """Check the flags against the deployment guide's constraints; return the local rank count.

    Raises `UsageError` with a one-line message on the first violation. With `dp_mode`
    "independent" the DP RPC port is unused, so it may fall among the API ports.
    """
    if args.dp_size < 1:
        raise UsageError(f"--dp-size must be >= 1, got {args.dp_size}")
    if args.tp_size < 1:
        raise UsageError(f"--tp-size must be >= 1, got {args.tp_size}")
    local = args.dp_size if args.dp_size_local == -1 else args.dp_size_local
    if not 1 <= local <= args.dp_size:
        raise UsageError(
            f"--dp-size-local must be -1 or between 1 and --dp-size ({args.dp_size}), got {args.dp_size_local}"
        )
    if args.dp_rank_start < 0:
        raise UsageError(f"--dp-rank-start must be >= 0, got {args.dp_rank_start}")
    if args.dp_rank_start + local > args.dp_size:
        raise UsageError(
            f"--dp-rank-start ({args.dp_rank_start}) + --dp-size-local ({local}) must be <= --dp-size "
            f"({args.dp_size}): ranks {args.dp_rank_start}..{args.dp_rank_start + local - 1} do not exist"
        )
    if not args.dp_address or not _valid_address(args.dp_address):
        raise UsageError(f"--dp-address must be an IP address or host name, got {args.dp_address!r}")
    if not _valid_port(args.dp_rpc_port):
        raise UsageError(f"--dp-rpc-port must be between 1 and 65535, got {args.dp_rpc_port}")
    last_port = args.vllm_start_port + local - 1
    if not _valid_port(args.vllm_start_port) or not _valid_port(last_port):
        raise UsageError(
            f"--vllm-start-port must leave {local} ports within 1..65535 (got {args.vllm_start_port}..{last_port})"
        )
    if dp_mode != "independent" and args.vllm_start_port <= args.dp_rpc_port <= last_port:
        raise UsageError(f"--dp-rpc-port {args.dp_rpc_port} falls in the API ports {args.vllm_start_port}..{last_port}")
    if args.stop_grace_s < 0:
        raise UsageError(f"--stop-grace-s must be >= 0, got {args.stop_grace_s}")
    for arg in extra:
        flag = arg.split("=", 1)[0]
        if flag in PER_RANK_FLAGS:
            raise UsageError(
                f"{flag} is set per rank by the launcher; use the launcher's flag instead of passing it after --"
            )
    if not args.template.is_file():
        raise UsageError(f"template {args.template} does not exist")
    return local


def parse_id_list(text: str, what: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]: ids and id ranges, none negative or repeated (`what` names the flag)."""
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                ids.extend(range(lo, hi + 1))
            else:
                ids.append(int(part))
        except ValueError:
            raise UsageError(f"{what}: {part!r} is not an id or an id range") from None
    if any(i < 0 for i in ids):
        raise UsageError(f"{what}: ids must be >= 0")
    if len(set(ids)) != len(ids):
        raise UsageError(f"{what}: ids must not repeat, got {text!r}")
    return ids
