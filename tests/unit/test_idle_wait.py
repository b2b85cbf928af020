"""pd_connector.idle_wait: P does not pause idle engine steps while busy; D and an idle P do."""

from __future__ import annotations

from pd_connector.idle_wait import BUSY_WINDOW_S, IDLE_WAIT_S, IdleWait


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_prefill_does_not_pause_within_the_busy_window_after_a_busy_step() -> None:
    clock = Clock()
    wait = IdleWait(no_wait_when_busy=True, clock=clock)
    assert wait.seconds(idle=True) == IDLE_WAIT_S  # never busy yet: an idle engine pauses as before
    assert wait.seconds(idle=False) == 0.0  # a prefill step
    clock.now += 0.010
    assert wait.seconds(idle=True) == 0.0  # holding the room for D, the next request may come any moment
    clock.now += BUSY_WINDOW_S - 0.011
    assert wait.seconds(idle=True) == 0.0
    clock.now += 0.002
    assert wait.seconds(idle=True) == IDLE_WAIT_S  # quiet for the whole window: pause again
    assert wait.seconds(idle=False) == 0.0
    assert wait.seconds(idle=True) == 0.0


def test_decode_always_pauses_idle_steps() -> None:
    clock = Clock()
    wait = IdleWait(no_wait_when_busy=False, clock=clock)
    assert wait.seconds(idle=False) == 0.0
    clock.now += 0.001
    assert wait.seconds(idle=True) == IDLE_WAIT_S
