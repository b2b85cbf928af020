"""Prefill/decode pairs whose decoder just refused the prefiller's KV as incompatible.

A decoder answers HTTP 409 ``kv_transfer_incompatible`` (pd_connector.api_server.validation: e.g. a
block-size mismatch) for a pair that can never transfer. On the first-token path that answer
comes after P's token 1 went to the client, so it can only end the stream with an error event.
The Router therefore remembers such a pair for a while and sends its next requests the two-instance
way, where the decoder's refusal reaches the client as the HTTP error it is. An entry lapses
after :data:`REFUSAL_TTL_S` (a fixed deployment is used fully again) or on the pair's next success.
"""

from __future__ import annotations

import time

from proxy.upstream.calls import Failure
from proxy.upstream.pool import BackendState

#: How long a refused pair stays off the first-token path.
REFUSAL_TTL_S = 60.0
_INCOMPATIBLE = b"kv_transfer_incompatible"


class PairRefusals:
    """The pairs a decoder refused, each until its expiry (monotonic seconds)."""

    def __init__(self, ttl_s: float = REFUSAL_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._until: dict[tuple[str, str], float] = {}

    def note(self, p: BackendState, failure: Failure) -> None:
        """Remember the pair when ``failure`` is the decoder's incompatibility answer."""
        if failure.state.backend.role != "decode" or failure.passthrough is None:
            return
        status, body, _ = failure.passthrough
        if status == 409 and _INCOMPATIBLE in body:
            self._until[(p.backend.address, failure.state.backend.address)] = time.monotonic() + self.ttl_s

    def clear(self, p: BackendState, d: BackendState) -> None:
        """The pair served a request: it is not refused (any more)."""
        if self._until:
            self._until.pop((p.backend.address, d.backend.address), None)

    def refused(self, p: BackendState, d: BackendState) -> bool:
        """Whether ``d`` refused ``p``'s KV as incompatible within the last :attr:`ttl_s` seconds."""
        if not self._until:
            return False
        key = (p.backend.address, d.backend.address)
        until = self._until.get(key)
        if until is None:
            return False
        if until < time.monotonic():
            del self._until[key]
            return False
        return True
