"""A batch's linger (app/engine/linger.py): the policy alone, then in a Batcher with a recording forward, lone
requests and requests announced on their way (Arrivals)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from app.engine.linger import PROBE_FIRST, PROBE_MOST, Arrival, Arrivals, Linger
from tests.test_batcher import RecordingForward, executor, make, rows  # noqa: F401 (executor: a fixture)


def decisions(linger: Linger, count: int) -> list[bool]:
    return [linger.worth_it() for _ in range(count)]


def test_a_linger_that_catches_nothing_is_not_tried_again_for_a_while_and_less_often_each_time():
    linger = Linger(0.002)
    assert linger.worth_it()  # the first lone request is a probe
    linger.caught(0)
    assert decisions(linger, PROBE_FIRST) == [False] * PROBE_FIRST
    assert linger.worth_it()  # the next probe
    linger.caught(0)
    assert decisions(linger, 2 * PROBE_FIRST) == [False] * (2 * PROBE_FIRST)
    assert linger.worth_it()
    for _ in range(20):  # backing off, never past PROBE_MOST
        linger.caught(0)
        skipped = 0
        while not linger.worth_it():
            skipped += 1
        assert skipped <= PROBE_MOST
    assert skipped == PROBE_MOST


def test_while_lingering_catches_requests_every_lone_request_lingers_and_one_miss_stops_it():
    linger = Linger(0.002)
    assert linger.worth_it()
    linger.caught(3)
    assert decisions(linger, 50) == [True] * 50
    linger.caught(1)
    assert linger.worth_it()
    linger.caught(0)  # a miss: computed at once from now on, until the next probe
    assert decisions(linger, PROBE_FIRST) == [False] * PROBE_FIRST
    assert linger.worth_it()
    linger.caught(2)  # a probe that catches: the backoff starts over
    assert linger.worth_it()
    linger.caught(0)
    assert decisions(linger, PROBE_FIRST) == [False] * PROBE_FIRST


def test_a_linger_needs_a_positive_cap():
    with pytest.raises(ValueError):
        Linger(0.0)


async def test_a_lone_request_is_joined_by_one_that_comes_while_it_lingers(executor):  # noqa: F811
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=64, linger_s=5.0)
    first = asyncio.create_task(batcher.submit(rows(1)))
    await asyncio.sleep(0.05)  # well inside the linger's quiet interval (2.5 s)
    second = asyncio.create_task(batcher.submit(rows(2, start=100.0)))
    out_first, out_second = await asyncio.wait_for(asyncio.gather(first, second), 30)
    assert forward.batches == [[1, 2]]  # one pass for both
    assert torch.equal(out_first, rows(1) * 2 + 1)
    assert torch.equal(out_second, rows(2, start=100.0) * 2 + 1)
    await batcher.stop()


async def test_a_lone_request_whose_deadline_is_near_does_not_linger(executor):  # noqa: F811
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=64, linger_s=30.0)
    loop = asyncio.get_running_loop()
    out = await asyncio.wait_for(batcher.submit(rows(1), deadline=loop.time() + 20.0), 15)  # long before 30 s
    assert torch.equal(out, rows(1) * 2 + 1)
    assert forward.batches == [[1]]
    await batcher.stop()


async def test_without_a_linger_a_lone_request_is_computed_at_once_as_before(executor):  # noqa: F811
    forward = RecordingForward()
    batcher = await make(forward, executor, max_batch_rows=64)  # linger_s 0, the Batcher's default
    out = await asyncio.wait_for(batcher.submit(rows(1)), 15)
    assert torch.equal(out, rows(1) * 2 + 1) and forward.batches == [[1]]
    await batcher.stop()


async def test_a_batch_waits_for_the_requests_announced_on_their_way_and_no_longer(executor):  # noqa: F811
    """Two requests queued together (no lone request) and two announced: one pass for all four, formed as
    soon as the last announced one is queued, long before the cap (60 s)."""
    forward = RecordingForward()
    arrivals = Arrivals(max_age_s=60.0)
    batcher = await make(forward, executor, max_batch_rows=64, linger_s=60.0, arrivals=arrivals)

    async def arrives(arrival: Arrival, x: torch.Tensor) -> torch.Tensor:
        arrival.arrived()  # as a door does: in the step that queues its rows
        return await batcher.submit(x)

    with arrivals.announced() as third, arrivals.announced() as fourth:
        queued = [asyncio.create_task(batcher.submit(rows(n, start=10.0 * n))) for n in (1, 2)]
        await asyncio.sleep(0.05)
        assert forward.batches == []  # waiting for the two on their way
        queued.append(asyncio.create_task(arrives(third, rows(3, start=30.0))))
        await asyncio.sleep(0.05)
        assert forward.batches == []  # one is still on its way
        queued.append(asyncio.create_task(arrives(fourth, rows(4, start=40.0))))
        answers = await asyncio.wait_for(asyncio.gather(*queued), 30)
    assert forward.batches == [[1, 2, 3, 4]]
    for n, answer in zip((1, 2, 3, 4), answers, strict=True):
        assert torch.equal(answer, rows(n, start=10.0 * n) * 2 + 1)
    assert arrivals.on_the_way == 0
    await batcher.stop()


async def test_an_announced_request_that_never_comes_ends_the_wait_when_it_ends(executor):  # noqa: F811
    """A call that fails before its rows are queued (its message refused, its client gone) wakes the batch."""
    forward = RecordingForward()
    arrivals = Arrivals(max_age_s=60.0)
    batcher = await make(forward, executor, max_batch_rows=64, linger_s=60.0, arrivals=arrivals)
    with arrivals.announced():
        task = asyncio.create_task(batcher.submit(rows(2)))
        await asyncio.sleep(0.05)
        assert forward.batches == []
    out = await asyncio.wait_for(task, 30)  # long before the 60 s cap
    assert torch.equal(out, rows(2) * 2 + 1) and forward.batches == [[2]]
    await batcher.stop()


async def test_a_request_on_its_way_longer_than_the_cap_is_not_waited_for(executor):  # noqa: F811
    """A client that starts a call and stalls its message holds no batch past its max age (the linger's cap
    in a server): two requests queued after it are computed at once, not after the 60 s linger."""
    forward = RecordingForward()
    arrivals = Arrivals(max_age_s=0.2)
    batcher = await make(forward, executor, max_batch_rows=64, linger_s=60.0, arrivals=arrivals)
    with arrivals.announced():  # never arrives
        await asyncio.sleep(0.5)
        assert arrivals.on_the_way == 0  # too old to wait for
        answers = await asyncio.wait_for(
            asyncio.gather(batcher.submit(rows(1)), batcher.submit(rows(2, start=50.0))), 30
        )
    assert sum(map(sum, forward.batches)) == 3
    assert torch.equal(answers[0], rows(1) * 2 + 1) and torch.equal(answers[1], rows(2, start=50.0) * 2 + 1)
    await batcher.stop()


async def test_announced_requests_are_not_waited_for_without_a_linger(executor):  # noqa: F811
    forward = RecordingForward()
    arrivals = Arrivals(max_age_s=60.0)
    batcher = await make(forward, executor, max_batch_rows=64, arrivals=arrivals)  # linger_s 0
    with arrivals.announced():
        out = await asyncio.wait_for(batcher.submit(rows(1)), 15)
    assert torch.equal(out, rows(1) * 2 + 1) and forward.batches == [[1]]
    await batcher.stop()


def test_an_arrival_counts_once_however_often_it_ends():
    arrivals = Arrivals(max_age_s=60.0)
    woken: list[int] = []
    with arrivals.lingering(lambda: woken.append(arrivals.on_the_way)):
        with arrivals.announced() as first, arrivals.announced():
            assert arrivals.on_the_way == 2
            first.arrived()
            first.arrived()
            assert arrivals.on_the_way == 1 and woken == []
        assert arrivals.on_the_way == 0 and woken == [0]
    with arrivals.announced():  # no batcher lingers now: nobody is woken
        pass
    assert woken == [0]


async def test_the_grpc_door_announces_a_call_until_its_message_is_read() -> None:
    """receive.read_with_room: the call is on its way from its start until its message is read; by the
    time the method (which queues its rows) runs, it has arrived, and a refused call arrives too."""
    from app.grpc.receive import Rooms, read_with_room
    from app.protocol.admission import HeldBytes

    arrivals = Arrivals(max_age_s=60.0)
    rooms = Rooms(HeldBytes(1 << 30), 1 << 20, read_timeout_s=60.0)
    message_sent = asyncio.Event()
    seen: list[tuple[object, int]] = []

    async def messages():
        await message_sent.wait()
        yield b"the message"

    async def unary(request: object, context: object) -> str:
        seen.append((request, arrivals.on_the_way))
        return "answered"

    behaviour = read_with_room(unary, lambda data: data.decode(), rooms, arrivals)
    call = asyncio.create_task(behaviour(messages(), None))
    await asyncio.sleep(0.05)
    assert arrivals.on_the_way == 1 and not seen  # on its way: its message has not come
    message_sent.set()
    assert await asyncio.wait_for(call, 30) == "answered"
    assert seen == [("the message", 0)] and arrivals.on_the_way == 0

    async def no_message():
        return
        yield

    assert await asyncio.wait_for(behaviour(no_message(), None), 30) == "answered"  # refused: a Malformed
    assert arrivals.on_the_way == 0
