"""Waits of one length on one timer (app/protocol/admission.py: Watch), on a real event loop.

The lengths are short and the checks come well after them; nothing asserts how soon a wait ended,
only which waits were called late, and how many timers they took.
"""

from __future__ import annotations

import asyncio
from typing import Any

from app.protocol.admission import COMPACT_AT, Watch

LENGTH_S = 0.05


def counting_timers(loop: asyncio.AbstractEventLoop, watch: Watch) -> list[float]:
    """Every timer `watch` arms on `loop` from now on (the plain asyncio loop's call_at, wrapped)."""
    armed: list[float] = []
    call_at = loop.call_at

    def counted(when: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        if getattr(callback, "__self__", None) is watch:
            armed.append(when)
        return call_at(when, callback, *args, **kwargs)

    loop.call_at = counted  # type: ignore[method-assign]
    return armed


async def test_a_wait_not_ended_in_time_is_called_late_once_and_an_ended_one_never() -> None:
    watch = Watch(LENGTH_S)
    late: list[str] = []
    ended = watch.start(lambda: late.append("ended"))
    live = watch.start(lambda: late.append("live"))
    ended.end()
    assert late == []
    await asyncio.sleep(LENGTH_S * 6)
    assert late == ["live"]
    assert live.ended and len(watch) == 0
    await asyncio.sleep(LENGTH_S * 3)
    assert late == ["live"]


async def test_many_waits_ended_in_time_take_one_timer_not_one_each() -> None:
    watch = Watch(LENGTH_S)
    armed = counting_timers(asyncio.get_running_loop(), watch)
    late: list[int] = []
    for index in range(1000):
        watch.start(lambda index=index: late.append(index)).end()
    assert len(armed) == 1
    await asyncio.sleep(LENGTH_S * 6)
    assert late == []
    assert len(armed) == 1  # it fired, found every wait ended, and was not armed again
    assert len(watch) == 0


async def test_waits_started_after_the_timer_fired_are_watched_by_a_timer_of_their_own() -> None:
    watch = Watch(LENGTH_S)
    late: list[str] = []
    watch.start(lambda: late.append("first"))
    await asyncio.sleep(LENGTH_S * 4)
    watch.start(lambda: late.append("second"))
    watch.start(lambda: late.append("third")).end()
    await asyncio.sleep(LENGTH_S * 6)
    assert late == ["first", "second"]


async def test_ended_waits_behind_a_long_one_do_not_pile_up() -> None:
    watch = Watch(60.0)
    late: list[str] = []
    stalled = watch.start(lambda: late.append("stalled"))  # a client that never sends its message
    for _ in range(10_000):
        watch.start(lambda: late.append("quick")).end()
    assert len(watch) <= 2 * COMPACT_AT
    stalled.end()
    assert late == []


def test_a_watch_serves_a_second_event_loop_after_the_first_is_gone() -> None:
    watch = Watch(LENGTH_S)
    late: list[str] = []

    async def one_wait(name: str) -> None:
        watch.start(lambda: late.append(name))
        await asyncio.sleep(LENGTH_S * 6)

    asyncio.run(one_wait("first loop"))
    asyncio.run(one_wait("second loop"))
    assert late == ["first loop", "second loop"]
