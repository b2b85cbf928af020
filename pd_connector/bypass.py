"""Requests a P or D instance served without a KV transfer: why, one log line each, and a count.

A front end that does not speak PDConnector's ``kv_transfer_params`` (or speaks them to the wrong
instance) still gets correct answers: P decodes the whole answer itself, or D recomputes the
prompt. Nothing fails, only latency and cost double, so such a request is logged (request id and
reason) and counted in ``vllm:pd_requests_without_transfer_total{reason}`` (pd_connector.metrics).

Pure bookkeeping for the scheduler side (no I/O): ``BypassCounter.take`` hands the counts since
the previous call to ``PDConnector.get_kv_connector_stats`` on the scheduler (vLLM >= 0.32 adds
the scheduler's stats to the workers').
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from pd_connector.kv_params import DecodeParams, KVParamsError, PrefillParams, parse_kv_params

logger = logging.getLogger(__name__)

#: Key of the stats interval dict holding {reason: count}.
BYPASS_KEY = "bypassed"


class BypassReason(enum.Enum):
    """The ``reason`` label: why a request was served without a transfer."""

    NO_PARAMS = "no_kv_transfer_params"  # the request carried no kv_transfer_params at all
    MALFORMED = "malformed_kv_transfer_params"  # they did not parse (logged where parsed)
    NOT_ASKED = "no_transfer_asked"  # they asked neither do_remote_decode nor do_remote_prefill
    WRONG_ROLE = "wrong_role"  # P got D's params (asked to decode), or D got P's
    PREFIX_CACHED = "prefix_cached"  # D: its own prefix cache held every prefilled token (expected)
    WINDOW_RECOMPUTE = "window_recompute"  # D: the prompt is prefilled locally (sliding window edge)
    STATE_RECOMPUTE = "state_recompute"  # D: recurrent-state model, one-token prompt or P's first token appended


BYPASS_REASONS: tuple[str, ...] = tuple(r.value for r in BypassReason)
#: Reasons that mean a front end or a client did not use PD: what to alert on.
MISROUTED = (BypassReason.NO_PARAMS, BypassReason.MALFORMED, BypassReason.NOT_ASKED, BypassReason.WRONG_ROLE)

_WHY = {
    BypassReason.NO_PARAMS: "the request carried no kv_transfer_params",
    BypassReason.MALFORMED: "its kv_transfer_params are malformed",
    BypassReason.NOT_ASKED: "its kv_transfer_params ask for no transfer",
    BypassReason.PREFIX_CACHED: "every prefilled token was in the local prefix cache",
    BypassReason.WINDOW_RECOMPUTE: "its prompt ends where a sliding window opens a block",
    BypassReason.STATE_RECOMPUTE: "a recurrent-state model's prompt of one token, or with prefill's first token appended",
}


def reason_for(is_prefill: bool, raw: Any, params: PrefillParams | DecodeParams | None) -> BypassReason | None:
    """Why a request that ``params`` (parsed from ``raw``) describes moves no KV on this role; None if it does."""
    wanted = PrefillParams if is_prefill else DecodeParams
    if isinstance(params, wanted):
        return None
    if params is not None:
        return BypassReason.WRONG_ROLE
    if raw is None or raw == {}:
        return BypassReason.NO_PARAMS
    try:
        parse_kv_params(raw, room_optional=True)
    except KVParamsError:
        return BypassReason.MALFORMED
    return BypassReason.NOT_ASKED


class BypassCounter:
    """Counts and logs requests served without a transfer (scheduler side, one engine)."""

    def __init__(self, side: str) -> None:
        self.side = side
        self._counts: dict[str, int] = {}

    def record(self, request_id: str, reason: BypassReason) -> None:
        if reason is BypassReason.WRONG_ROLE:
            why = (
                "it asks this prefill instance to decode (do_remote_prefill)"
                if self.side == "prefill"
                else "it asks this decode instance to prefill for another (do_remote_decode)"
            )
        else:
            why = _WHY[reason]
        log = logger.warning if reason in MISROUTED else logger.info
        log("req=%s served by %s without a KV transfer (%s): %s", request_id, self.side, reason.value, why)
        self._counts[reason.value] = self._counts.get(reason.value, 0) + 1

    def take(self) -> dict[str, int] | None:
        """Counts since the previous call, or None when there are none."""
        if not self._counts:
            return None
        counts, self._counts = self._counts, {}
        return counts
