"""What a strategy may use of the client request it serves: :class:`RequestContext`.

The strategies (:mod:`proxy.strategies.two_instance`, :mod:`proxy.strategies.first_token`,
:mod:`proxy.strategies.recompute`, :mod:`proxy.strategies.resume`, :mod:`proxy.strategies.kv_move`) take a
request context, never the request's handler itself: its attempts through :attr:`RequestContext.loop`
(:class:`proxy.request.loop.AttemptLoop`: rooms, counts, attempts, failures, P's room), its answer
through the client-side methods below. A strategy returns the client's answer, or a
:class:`proxy.request.loop.Next` that says which strategy the request goes on with.
:class:`proxy.request.exchange.Exchange` is the one implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from proxy.errors import RouterError
    from proxy.request.attempt import Call, Cut
    from proxy.request.loop import AttemptLoop, Won
    from proxy.request.progress import RequestProgress
    from proxy.router_state import Router
    from proxy.server.reply import BodyReply, ClientReply, StreamReply
    from proxy.strategies.first_token_body import FirstTokenFrom
    from proxy.strategies.resume_body import StreamTracker
    from proxy.upstream.calls import Failure


class RequestContext(Protocol):
    """One client request as its strategies see it."""

    @property
    def router(self) -> Router:
        """The Router (its config, pool, metrics, drains, pair refusals, prefill watch)."""
        ...

    @property
    def call(self) -> Call:
        """What the client asked: endpoint, body, headers, request id."""
        ...

    @property
    def rid(self) -> str:
        """The request id (every log line about the request names it)."""
        ...

    @property
    def endpoint(self) -> str: ...

    @property
    def loop(self) -> AttemptLoop:
        """The request's attempts."""
        ...

    @property
    def progress(self) -> RequestProgress:
        """The request's room, attempts, first byte and moves (the loop's)."""
        ...

    # -- the client's answer ------------------------------------------------------------------

    def stream_response(self, status: int, content_type: str | None) -> ClientReply:
        """The client's streamed answer, not yet opened."""
        ...

    async def open_stream(self, response: StreamReply) -> None:
        """Send ``response``'s status and headers to the client."""
        ...

    def first_byte(self, source: FirstTokenFrom | None = None) -> None:
        """The client got the answer's first byte now (``source``: who sent its first token)."""
        ...

    def answered(self, status: int, body: bytes, content_type: str) -> BodyReply:
        """A whole answer for the client, as it is."""
        ...

    def error(self, error: RouterError) -> BodyReply:
        """The client's answer for a Router-side error (counted and logged)."""
        ...

    def final_failure(self, failure: Failure) -> BodyReply:
        """The client's answer once no attempt is left: the last failure."""
        ...

    async def answer(self, won: Won) -> ClientReply:
        """D's answer (of the attempt that ``won``) to the client: whole, or its stream relayed."""
        ...

    async def relay(
        self,
        won: Won,
        response: StreamReply | None = None,
        transform: Callable[[bytes], bytes] | None = None,
        tracker: StreamTracker | None = None,
    ) -> ClientReply:
        """The stream of the attempt that ``won`` to the client on ``response`` (a new one when None),
        resumed where it can be."""
        ...

    def stream_cut(self, cut: Cut) -> None:
        """A stream that began ends with ``cut``'s failure (its attempt closed by
        :meth:`proxy.request.loop.AttemptLoop.cut`): counted, logged."""
        ...
