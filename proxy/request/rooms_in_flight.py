"""Bootstrap rooms of the requests in flight: one request per room at a time.

A room names one prompt's KV on P. Two requests with the same room at once would make P file
two prefills under one name and D load the wrong one, so a room already in flight is refused at
once (HTTP 409 ``room_in_use``). Rooms are client-chosen only with ``--trust-client-room``;
otherwise every request gets a fresh random 63-bit one and a clash is practically impossible.

:class:`RoomsInUse` is also the Router's one room factory: every room the Router makes (a request's
first room, a retry's, a continuation's or a resumed leg's, a decoder's migrate room) is drawn by
:meth:`RoomsInUse.fresh` from one random source, and claimed until the request that drew it ends
(:meth:`proxy.request.loop.AttemptLoop.close`).
"""

from __future__ import annotations

import random

from proxy.errors import ROOM_IN_USE, RouterError
from proxy.request.payloads import new_room


class RoomsInUse:
    """The rooms of the Router's exchanges in flight (one asyncio loop: no lock)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rooms: set[int] = set()
        #: The one random source of the Router's rooms.
        self.rng = rng or random.Random()

    def fresh(self) -> int:
        """A new random 63-bit room, claimed (no request in flight has it)."""
        room = new_room(self.rng)
        while room in self._rooms:
            room = new_room(self.rng)
        self._rooms.add(room)
        return room

    def claim(self, room: int) -> None:
        """Take ``room`` for one request; raises RouterError (409) if another request has it."""
        if room in self._rooms:
            raise RouterError(
                409, f"bootstrap_room {room} is in use by another request in flight", ROOM_IN_USE, "bootstrap_room"
            )
        self._rooms.add(room)

    def release(self, room: int) -> None:
        self._rooms.discard(room)

    def __len__(self) -> int:
        return len(self._rooms)
