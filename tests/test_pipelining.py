"""PipelineTurns: the connections with a pipelined request to start take turns, one a loop iteration."""

from __future__ import annotations

import asyncio

import pytest

from app.http.transport.budgets import PipelineTurns


class FakeConnection:
    def __init__(self, name: str, log: list[str], fail: bool = False) -> None:
        self.name, self.log, self.fail = name, log, fail

    def take_turn(self) -> None:
        self.log.append(self.name)
        if self.fail:
            raise RuntimeError(f"{self.name} broke on its turn")


async def iterations(n: int) -> None:
    """Let the loop run `n` more iterations (each sleep(0) resumes in the next one)."""
    for _ in range(n):
        await asyncio.sleep(0)


async def test_one_turn_a_loop_iteration_first_asked_first_served() -> None:
    loop = asyncio.get_running_loop()
    turns, log = PipelineTurns(), []
    a, b, c = (FakeConnection(name, log) for name in "abc")
    for connection in (a, b, c):
        turns.ask(connection, loop)
    assert log == [] and len(turns) == 3  # nothing runs inside the callback that asked
    await iterations(1)
    assert log == ["a"]
    await iterations(1)
    assert log == ["a", "b"]
    await iterations(3)
    assert log == ["a", "b", "c"] and len(turns) == 0


async def test_asking_again_before_the_turn_keeps_one_place_and_a_withdrawn_connection_gets_none() -> None:
    loop = asyncio.get_running_loop()
    turns, log = PipelineTurns(), []
    a, b, c = (FakeConnection(name, log) for name in "abc")
    turns.ask(a, loop)
    turns.ask(b, loop)
    turns.ask(a, loop)
    turns.ask(c, loop)
    turns.withdraw(b)  # it closed
    await iterations(5)
    assert log == ["a", "c"]


async def test_a_connection_that_fails_on_its_turn_does_not_stop_the_others() -> None:
    loop = asyncio.get_running_loop()
    errors: list[BaseException] = []
    loop.set_exception_handler(lambda _, context: errors.append(context["exception"]))
    turns, log = PipelineTurns(), []
    broken, fine = FakeConnection("broken", log, fail=True), FakeConnection("fine", log)
    turns.ask(broken, loop)
    turns.ask(fine, loop)
    await iterations(4)
    assert log == ["broken", "fine"]
    assert [str(e) for e in errors] == ["broken broke on its turn"]  # reported as the loop reports a callback's


@pytest.mark.parametrize("asked_after", [0, 3])
async def test_turns_resume_when_asked_again_after_the_queue_emptied(asked_after: int) -> None:
    loop = asyncio.get_running_loop()
    turns, log = PipelineTurns(), []
    a = FakeConnection("a", log)
    turns.ask(a, loop)
    await iterations(1 + asked_after)
    turns.ask(a, loop)
    await iterations(1)
    assert log == ["a", "a"]
