"""The event loop of the hand-off's processes: uvloop where it is installed, as uvicorn's loop="auto"
picks for the doors, else asyncio's own; both ends of the hand-off run on the loop a served front has."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:  # an optional speed-up: the hand-off works on asyncio's loop too
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run_on_served_loop(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the loop a served process has."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
