"""Rooms for ModelInfer and ModelStreamInfer messages on their way (app/grpc/receive.py): taken from the held budget, handed on in turn.

No server: the rooms and a HeldBytes budget alone. The real door under floods is tests/test_grpc_budgets.py's.
"""

from __future__ import annotations

import asyncio

import pytest

from app.grpc.receive import STREAM_WINDOW, Rooms
from app.protocol.admission import HeldBytes, Hold
from app.protocol.errors import TooManyBytesHeld

MiB = 1024 * 1024


def rooms(held_mib: int = 256, largest_mib: int = 64, read_timeout_s: float = 60.0) -> tuple[HeldBytes, Rooms]:
    held = HeldBytes(held_mib * MiB)
    return held, Rooms(held, largest_mib * MiB, read_timeout_s)


def test_rooms_take_at_most_half_the_budget_and_one_at_least() -> None:
    assert rooms(256, 64)[1].limit == 2
    assert rooms(1024, 64)[1].limit == 8
    assert rooms(64, 64)[1].limit == 1  # max_held_bytes = max_body_bytes: one message on its way at a time
    _, some = rooms(256, 64)
    assert some.max_waiting == 256 * MiB // 4 // STREAM_WINDOW  # a quarter of the budget in 64 KiB windows


async def test_a_room_is_held_against_the_budget_until_given_back() -> None:
    held, some = rooms()
    room = await some.take()
    assert held.held == 64 * MiB
    some.give(room)
    assert held.held == 0 and some.taken == 0


async def test_calls_past_the_rooms_wait_and_are_handed_a_room_in_turn() -> None:
    held, some = rooms()
    first, second = await some.take(), await some.take()
    order: list[str] = []

    async def wait(name: str) -> Hold:
        room = await some.take()
        order.append(name)
        return room

    third = asyncio.create_task(wait("third"))
    await asyncio.sleep(0)
    fourth = asyncio.create_task(wait("fourth"))
    await asyncio.sleep(0)
    assert not third.done() and not fourth.done()
    some.give(first)
    third_room = await third
    assert order == ["third"] and not fourth.done()
    some.give(second)
    fourth_room = await fourth
    assert order == ["third", "fourth"]
    assert held.held == 128 * MiB and some.taken == 2
    some.give(third_room)
    some.give(fourth_room)
    assert held.held == 0 and some.taken == 0


async def test_a_call_that_gets_no_room_in_time_is_refused_and_leaves_nothing_behind() -> None:
    held, some = rooms(read_timeout_s=0.05)
    taken = [await some.take(), await some.take()]
    with pytest.raises(TooManyBytesHeld, match="no room for a gRPC infer message within"):
        await some.take()
    for room in taken:
        some.give(room)
    assert held.held == 0 and some.taken == 0
    assert (await some.take()).size == 64 * MiB  # free again, taken at once


async def test_a_waiting_call_cancelled_leaves_the_line_and_one_handed_a_room_as_it_goes_hands_it_on() -> None:
    held, some = rooms()
    first, second = await some.take(), await some.take()
    leaving = asyncio.create_task(some.take())
    staying = asyncio.create_task(some.take())
    await asyncio.sleep(0)
    some.give(first)  # handed to `leaving`, which is cancelled before it wakes
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    room = await staying  # so the room went on to the next in line
    assert some.taken == 2 and held.held == 128 * MiB
    some.give(room)
    some.give(second)
    assert held.held == 0 and some.taken == 0


async def test_no_room_while_the_calls_being_answered_hold_the_budget() -> None:
    held, some = rooms()
    answers = Hold(held)
    answers.grow(200 * MiB)  # what calls being answered hold: 56 MiB left, less than a room
    with pytest.raises(TooManyBytesHeld):
        await some.take()
    assert some.taken == 0 and held.held == 200 * MiB
    answers.resize(0)
    some.give(await some.take())
    assert held.held == 0


async def test_past_the_calls_that_may_wait_a_call_is_refused_at_once() -> None:
    held = HeldBytes(4 * STREAM_WINDOW * 2)  # room for two waiting calls' windows
    some = Rooms(held, held.limit // 2, 60.0)
    assert some.limit == 1 and some.max_waiting == 2
    room = await some.take()
    waiting = [asyncio.create_task(some.take()) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(TooManyBytesHeld, match="wait; retry shortly"):
        await some.take()
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    some.give(room)
    assert held.held == 0 and some.taken == 0


async def test_a_waiting_call_cancelled_as_a_room_is_given_back_leaves_the_line_once() -> None:
    # Cancelling a task cancels the turn it waits on at once; the room given back in the same turn of
    # the loop passes that turn by (taking it out of the line) before the call itself wakes to leave.
    held, some = rooms(128, 64)
    room = await some.take()
    leaving = asyncio.create_task(some.take())
    staying = asyncio.create_task(some.take())
    await asyncio.sleep(0)
    leaving.cancel()
    some.give(room)
    with pytest.raises(asyncio.CancelledError):
        await leaving
    some.give(await staying)
    assert held.held == 0 and some.taken == 0


async def test_a_call_that_finds_no_room_asks_the_reader_quiet_longest_and_only_that_one() -> None:
    """Rooms held by readers (streams between their messages): a call that finds none asks the reader that has
    waited longest to give its room up, once it is quiet; one call, one reader asked."""
    held, some = rooms(256, 64, read_timeout_s=10.0)  # two rooms; a reader is quiet after 5 s
    assert some.quiet_s == 5.0
    first_room = await some.take()
    first = some.reader()
    second_room = await some.take()
    second = some.reader()
    taker = asyncio.create_task(some.take())
    loop = asyncio.get_running_loop()
    give_up = loop.time() + 60
    while not first.asked.done():  # asked once it is quiet
        assert loop.time() < give_up, "the quietest reader was never asked"
        await asyncio.sleep(0.05)
    assert not second.asked.done() and not taker.done()
    some.give(first_room, first)  # as the stream does when asked: its room goes to the call
    room = await asyncio.wait_for(taker, 30)
    assert held.held == 2 * 64 * MiB and not second.asked.done()
    some.give(room)
    some.give(second_room, second)
    assert held.held == 0 and some.taken == 0


async def test_a_reader_not_yet_quiet_keeps_its_room_and_the_call_waits_its_read_timeout() -> None:
    held, some = rooms(64, 64, read_timeout_s=1.0)  # the budget's one room
    some.quiet_s = 3600.0  # this test's reader never becomes quiet
    room = await some.take()
    reader = some.reader()
    with pytest.raises(TooManyBytesHeld, match="no room for a gRPC infer message within 1 s"):
        await some.take()
    assert not reader.asked.done()
    some.give(room, reader)
    assert held.held == 0 and some.taken == 0
