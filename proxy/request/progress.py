"""What one client request's attempts have done so far: :class:`RequestProgress`.

Each request's :class:`proxy.request.loop.AttemptLoop` holds one and keeps it up to date whichever strategy
runs the request's attempts (two-instance, first-token, recompute, resume, KV move); the strategies read it
through their :class:`proxy.request.context.RequestContext`, and the exchange's log line reads it however
the request ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.strategies.first_token_body import FirstTokenFrom


@dataclass(slots=True)
class RequestProgress:
    """The request's current room, how many attempts it made, and its first byte."""

    #: The bootstrap room of the current attempt (a fresh one on each retry).
    room: int
    #: Attempts made so far (the log line's ``attempts=``).
    attempts: int = 0
    #: Seconds from the request's arrival to the first byte of its answer.
    ttfb: float | None = None
    #: Who sent the client's first token.
    first_token_from: FirstTokenFrom = FirstTokenFrom.DECODE
    #: Resumed legs tried after the stream was cut (:mod:`proxy.strategies.resume`).
    resumes: int = 0
    #: Where the request moved: ``(phase, wall-clock time)`` marks for its phase trace
    #: (``d_cut``, ``resumed``; numbered after the first).
    moves: list[tuple[str, float]] = field(default_factory=list)
    #: The decoders a resumed stream went through, in order (the log line's ``moved=``).
    decoders: list[str] = field(default_factory=list)
