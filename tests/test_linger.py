"""A lone request's linger (app/engine/linger.py): the policy alone, then in a Batcher with a recording forward."""

from __future__ import annotations

import asyncio

import pytest
import torch

from app.engine.linger import PROBE_FIRST, PROBE_MOST, Linger
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
