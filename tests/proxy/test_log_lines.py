"""proxy/server/log_lines.py: lines logged in one event-loop turn reach the stream in one write, that turn."""

from __future__ import annotations

import asyncio
import io
import logging
import threading

from proxy.server.log_lines import LoopFlushingHandler


class _Stream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def _logger(stream: _Stream) -> logging.Logger:
    logger = logging.getLogger(f"test-log-lines-{id(stream)}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = LoopFlushingHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.handlers = [handler]
    return logger


def test_lines_of_one_loop_turn_are_one_write_at_its_end() -> None:
    stream = _Stream()
    logger = _logger(stream)

    async def main() -> list[str]:
        for i in range(3):
            logger.info("rid=r%d done", i)
        before = list(stream.writes)
        await asyncio.sleep(0)  # the turn ends
        await asyncio.sleep(0)
        return before

    assert asyncio.run(main()) == []
    assert stream.writes == ["INFO rid=r0 done\nINFO rid=r1 done\nINFO rid=r2 done\n"]


def test_without_a_loop_or_off_its_thread_a_line_is_written_at_once() -> None:
    stream = _Stream()
    logger = _logger(stream)
    logger.warning("no loop")
    assert stream.writes == ["WARNING no loop\n"]

    async def from_a_thread() -> None:
        thread = threading.Thread(target=logger.info, args=("from a thread",))
        thread.start()
        thread.join()
        assert stream.writes[-1] == "INFO from a thread\n"

    asyncio.run(from_a_thread())


def test_lines_left_by_a_stopped_loop_come_first_and_flush_writes_them() -> None:
    stream = _Stream()
    logger = _logger(stream)
    loop = asyncio.new_event_loop()

    async def log_only() -> None:
        logger.info("pending")

    loop.run_until_complete(log_only())
    loop.close()  # its call_soon never ran
    logger.info("later")
    assert "".join(stream.writes) == "INFO pending\nINFO later\n"
    logger.handlers[0].flush()
    assert "".join(stream.writes) == "INFO pending\nINFO later\n"
