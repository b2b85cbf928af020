"""Explicit states of a room on P and of a KV load on D, and why P closed a room."""

from __future__ import annotations

import enum


class RoomState(enum.Enum):
    """A room on a P rank (``rooms.Room``; only ``prefill_side.PrefillSide`` moves it)."""

    AWAITING_PREFILL = "awaiting prefill"  # D asked first; its requests wait for the prefill
    READY = "ready"  # prefill done, KV held: D requests are served (request-mode pushes run in this state)
    DRAINING = "draining"  # room_timeout_s passed: no new request; freed once in-flight writes end
    CLOSED = "closed"  # freed (out of the table); a late D request is refused with the CloseReason


class CloseReason(enum.Enum):
    """Why a room was closed; told to a D rank that asks for it afterwards."""

    SENT = "sent"
    EXPIRED = "expired"
    ABORTED = "aborted"
    CANCELLED = "cancelled"

    def message(self, held_s: float) -> str:
        """``held_s``: how long an expired room was held unclaimed (its room_timeout_s or hold_s)."""
        if self is CloseReason.EXPIRED:
            return f"prefill freed the KV after waiting {held_s:g} s for decode"
        return _MESSAGES[self]


_MESSAGES = {
    CloseReason.SENT: "KV of this room was already sent",
    CloseReason.ABORTED: "prefill request was aborted before its KV was ready",
    CloseReason.CANCELLED: "decode cancelled the transfer",
}


class LoadState(enum.Enum):
    """A KV load on a D rank."""

    RESOLVING = "resolving"  # handshake running: route lookup, which P ranks to ask
    AWAITING_KV = "awaiting KV"  # requests sent; waiting for TransferDone from every P rank asked
    CANCELLING = "cancelling"  # vLLM aborted the request: P told to stop; waiting for its last answers
    RECEIVED = "received"
    FAILED = "failed"
