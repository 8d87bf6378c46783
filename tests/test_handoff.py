"""The hand-off between a front and an engine (app/handoff): answers equal to numpy through the
arena's slots, small and large, the engine's errors as it raised them, back-pressure when the slots run
out, generations that keep an old answer from being read as a new one, and an engine killed with
a request in flight: the request fails at once, and a restarted engine serves the same client."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.config.settings import load_settings
from app.engine.errors import ModelNotFound, Overloaded, RequestTooLarge, Unavailable
from app.engine.montecarlo import MonteCarloRequest
from app.engine.registry import Registry, ServedModel
from app.engine.service import Engine
from app.handoff.arena import Arena
from app.handoff.engine import EngineServer
from app.handoff.frames import LENGTH, encode
from app.handoff.front import Ask, EngineClient
from app.handoff.messages import Hello
from app.observe.metrics import Metrics
from app.process.engine_process import launch, yield_to_fronts
from ffn_core import load_ffn
from ffn_core.dtypes import DTYPES
from tests.reference import assert_close, demo_reference, numpy_ffn, numpy_weights
from tests.slow_model import slow_model_config

F32, F16 = DTYPES["float32"], DTYPES["float16"]
D_MODEL = 512  # the demo model's


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, D_MODEL)).astype(np.float32)


@pytest.fixture
async def engine(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Engine]:
    monkeypatch.setenv("FFN_WARMUP", "0")
    settings = load_settings()
    served = Engine(settings, Registry(settings, Metrics()))
    await served.start()
    await served.until_warm()
    yield served
    await served.stop()


@pytest.fixture
async def served(engine: Engine, tmp_path: Path) -> AsyncIterator[Path]:
    """The engine's models on a Unix socket; the socket's path."""
    path = tmp_path / "engine.sock"
    server = EngineServer(engine, path)
    await server.start()
    yield path
    await server.close()


async def test_answers_equal_numpy_through_a_slot_and_a_large_slot_of_their_own(served: Path) -> None:
    # 8 float32 rows fit a slot; the large area holds 2 MiB.
    client = EngineClient(served, slots=4, slot_bytes=8 * D_MODEL * 4, large_bytes=2 << 20)
    try:
        small, large = rows(3, 1), rows(40, 2)  # large: 80 KiB, past a slot: a slot of its own size
        half = rows(12, 4).astype(np.float16)  # fits a slot; its float32 answer does not: a large slot
        answers = await asyncio.gather(
            client.infer(Ask("demo", None, small, F32, deadline=None)),
            client.infer(Ask("demo", None, large, F32, deadline=None)),
            client.infer(Ask("demo", None, small, F16, deadline=None)),
            client.infer(Ask("demo", None, half, F32, deadline=None)),
        )
        assert_close(answers[0], demo_reference(small.astype(np.float64)))
        assert_close(answers[1], demo_reference(large.astype(np.float64)))
        assert answers[2].dtype == np.float16
        assert_close(answers[2].astype(np.float32), demo_reference(small.astype(np.float64)), rtol=2e-3)
        assert answers[3].dtype == np.float32
        assert_close(answers[3], demo_reference(half.astype(np.float64)), rtol=2e-3)
        assert client.in_flight == 0
        link = client._link
        assert link is not None and link.arena.large_free == 2 << 20  # every large slot given back, merged
        with pytest.raises(RequestTooLarge, match="more than this process's hand-off holds"):
            await client.infer(Ask("demo", None, rows(1100, 3), F32, deadline=None))  # 2.1 MiB
    finally:
        await client.close()


async def test_infer_soon_sends_at_once_once_linked_and_an_ask_goes_to_the_call_of_its_kind(served: Path) -> None:
    client = EngineClient(served)
    try:
        x, request = rows(3, 5), MonteCarloRequest(passes=2, dropout=0.1, seed=1)
        with pytest.raises(ValueError, match="infer_monte_carlo"):
            await client.infer(Ask("demo", None, x, F32, deadline=None, monte_carlo=request))
        with pytest.raises(ValueError, match="infer_monte_carlo"):
            client.infer_soon(Ask("demo", None, x, F32, deadline=None, monte_carlo=request))
        with pytest.raises(ValueError, match="monte_carlo"):
            await client.infer_monte_carlo(Ask("demo", None, x, F32, deadline=None))
        first = client.infer_soon(Ask("demo", None, x, F32, deadline=None))  # no link yet: a task waits for one
        assert client.in_flight == 0
        assert_close(await first, demo_reference(x))
        second = client.infer_soon(Ask("demo", None, x, F32, deadline=None))  # linked: sent before it returns
        assert client.in_flight == 1
        assert_close(await second, demo_reference(x))
        assert client.in_flight == 0
    finally:
        await client.close()


async def test_a_monte_carlo_answer_crosses_whole(served: Path, engine: Engine) -> None:
    client = EngineClient(served)
    try:
        x, request = rows(4, 3), MonteCarloRequest(passes=8, dropout=0.25, seed=7)
        crossed = await client.infer_monte_carlo(Ask("demo", None, x, F32, deadline=None, monte_carlo=request))
        direct = await engine.model("demo").infer_monte_carlo(x, request, F32, deadline=None)
        np.testing.assert_array_equal(crossed.mean, direct.mean)  # the same seed: the same passes
        np.testing.assert_array_equal(crossed.std, direct.std)
        assert crossed.mean.shape == crossed.std.shape == (4, D_MODEL) and np.all(crossed.std > 0)
    finally:
        await client.close()


async def test_the_engines_errors_cross_as_it_raised_them(served: Path) -> None:
    client = EngineClient(served)
    try:
        with pytest.raises(ModelNotFound) as missing:
            await client.infer(Ask("nope", None, rows(1), F32, deadline=None))
        assert missing.value.name == "nope" and missing.value.version is None
        assert "is not served here" in missing.value.message
        assert_close(await client.infer(Ask("demo", None, rows(1), F32, deadline=None)), demo_reference(rows(1)))
    finally:
        await client.close()


def sample(metrics: Metrics, name: str, model: str) -> float:
    return metrics.registry.get_sample_value(name, {"model": model}) or 0.0


async def test_a_frames_requests_are_queued_together_each_answered_and_counted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FFN_WARMUP", "0")
    metrics = Metrics()
    settings = load_settings()
    engine = Engine(settings, Registry(settings, metrics))
    await engine.start()
    await engine.until_warm()
    offered: list[list[int] | None] = []
    infer_soon = ServedModel.infer_soon

    def recording(self: ServedModel, *args: Any, requests: Any = None, **kwargs: Any) -> Any:
        offered.append(None if requests is None else list(requests))
        return infer_soon(self, *args, requests=requests, **kwargs)

    monkeypatch.setattr(ServedModel, "infer_soon", recording)
    server = EngineServer(engine, tmp_path / "engine.sock")
    await server.start()
    client = EngineClient(tmp_path / "engine.sock")
    try:
        assert_close(await client.infer(Ask("demo", None, rows(1), F32, deadline=None)), demo_reference(rows(1)))
        offered.clear()  # that one opened the link; what follows is asked in one turn: one frame
        sizes = [1 + i % 4 for i in range(30)]  # 75 rows in 30 requests
        xs = [rows(n, seed) for seed, n in enumerate(sizes)]
        answers = await asyncio.gather(
            *(client.infer(Ask("demo", None, x, F32, deadline=None)) for x in xs),
            *(client.infer(Ask("demo", None, x, F16, deadline=None)) for x in xs[:3]),
        )
        for x, answer in zip(xs, answers[:30], strict=True):
            assert answer.dtype == np.float32
            assert_close(answer, demo_reference(x.astype(np.float64)))
        for x, answer in zip(xs[:3], answers[30:], strict=True):
            assert answer.dtype == np.float16
            assert_close(answer.astype(np.float32), demo_reference(x.astype(np.float64)), rtol=2e-3)
        # One entry per (model, dtypes) of the frame: the float32 ones together, the float16 ones together.
        assert offered == [sizes, sizes[:3]], offered
        assert sample(metrics, "ffn_request_rows_count", "demo") == 1 + 33
        assert sample(metrics, "ffn_request_rows_sum", "demo") == 1 + sum(sizes) + sum(sizes[:3])
        assert sample(metrics, "ffn_request_seconds_count", "demo") == 1 + 33
        assert sample(metrics, "ffn_failed_request_seconds_count", "demo") == 0
        assert client.in_flight == 0
    finally:
        await client.close()
        await server.close()
        await engine.stop()


@pytest.fixture
async def slow_served(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> AsyncIterator[tuple[Path, Metrics]]:
    """The slow model's engine (tests/slow_model.py), warm-up off, served on a socket: its path and its metrics."""
    monkeypatch.setenv("FFN_WARMUP", "0")
    metrics = Metrics()
    settings = load_settings(config=slow_model_config(tmp_path))
    engine = Engine(settings, Registry(settings, metrics))
    await engine.start()
    await engine.until_warm()
    server = EngineServer(engine, tmp_path / "engine.sock")
    await server.start()
    try:
        yield tmp_path / "engine.sock", metrics
    finally:
        await server.close()
        await engine.stop()


async def blocking(client: EngineClient, metrics: Metrics) -> asyncio.Task[np.ndarray]:
    """A 3000-row request, once its pass holds the model thread (seconds, longer on a busy machine): what follows
    queues behind it."""
    blocker = asyncio.create_task(client.infer(Ask("slow", None, rows(3000, 99), F32, deadline=None)))
    async with asyncio.timeout(60):
        while sample(metrics, "ffn_queue_seconds_count", "slow") < 1:
            await asyncio.sleep(0.01)
    return blocker


async def test_a_cancelled_request_leaves_its_group_and_the_others_are_answered(
    slow_served: tuple[Path, Metrics], tmp_path: Path
) -> None:
    socket_path, metrics = slow_served
    client = EngineClient(socket_path, slots=8)
    weights = numpy_weights(load_ffn(tmp_path / "slow.safetensors"))
    try:
        blocker = await blocking(client, metrics)
        xs = [rows(2, seed) for seed in range(4)]
        members = [asyncio.create_task(client.infer(Ask("slow", None, x, F32, deadline=None))) for x in xs]
        async with asyncio.timeout(60):  # the four go in one frame, queued as one entry
            while client.in_flight < 5:
                await asyncio.sleep(0)
        assert client.in_flight == 5
        members[1].cancel()
        with pytest.raises(asyncio.CancelledError):
            await members[1]
        answers = await asyncio.wait_for(asyncio.gather(blocker, members[0], members[2], members[3]), 60)
        assert_close(answers[0], numpy_ffn(rows(3000, 99), weights), rtol=1e-4)
        for x, answer in zip([xs[0], xs[2], xs[3]], answers[1:], strict=True):
            assert_close(answer, numpy_ffn(x, weights), rtol=1e-4)
        assert client.in_flight == 0  # the cancelled one's slot was given back when the engine said so
        assert sample(metrics, "ffn_request_seconds_count", "slow") == 5  # the group was computed for all
        assert sample(metrics, "ffn_failed_request_seconds_count", "slow") == 0
    finally:
        await client.close()


async def test_a_cancelled_large_request_keeps_its_slot_until_the_engine_answers_and_the_next_is_right(
    slow_served: tuple[Path, Metrics], tmp_path: Path
) -> None:
    """A large request's rows are read in place by the engine: its slot is taken again only once the engine
    has answered for it, and a later large request in the same memory is answered right."""
    socket_path, metrics = slow_served
    large = 16 << 20
    client = EngineClient(socket_path, slots=2, slot_bytes=4096, large_bytes=large)
    weights = numpy_weights(load_ffn(tmp_path / "slow.safetensors"))
    try:
        blocker = await blocking(client, metrics)
        gone = asyncio.create_task(client.infer(Ask("slow", None, rows(1000, 5), F32, deadline=None)))
        async with asyncio.timeout(60):
            while client.in_flight < 2:
                await asyncio.sleep(0)
        link = client._link
        assert link is not None
        taken = link.arena.large_free
        assert taken <= large - (3000 + 1000) * D_MODEL * 4  # both in large slots of their own
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert link.arena.large_free == taken  # not given back before the engine says so
        x = rows(1000, 6)
        later = await asyncio.wait_for(client.infer(Ask("slow", None, x, F32, deadline=None)), 120)
        assert_close(later, numpy_ffn(x, weights), rtol=1e-4)
        assert_close(await asyncio.wait_for(blocker, 120), numpy_ffn(rows(3000, 99), weights), rtol=1e-4)
        assert client.in_flight == 0 and link.arena.large_free == large  # every large slot back, merged
    finally:
        await client.close()


async def test_a_cancelled_small_request_keeps_its_slot_until_the_engine_answers_and_the_next_is_right(
    slow_served: tuple[Path, Metrics], tmp_path: Path
) -> None:
    """A small slot's rows are read in place too: the slot is taken again only once the engine has answered
    for its request, and the next request in that slot is answered right."""
    socket_path, metrics = slow_served
    client = EngineClient(socket_path, slots=2, slot_bytes=3000 * D_MODEL * 4, large_bytes=0)
    weights = numpy_weights(load_ffn(tmp_path / "slow.safetensors"))
    try:
        blocker = await blocking(client, metrics)  # in one slot
        gone = asyncio.create_task(client.infer(Ask("slow", None, rows(1000, 5), F32, deadline=None)))
        async with asyncio.timeout(60):
            while client.in_flight < 2:
                await asyncio.sleep(0)
        link = client._link
        assert link is not None and link.arena.free == 0  # both small slots taken
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert link.arena.free == 0  # not given back before the engine says so
        async with asyncio.timeout(120):
            while link.arena.free == 0:  # the engine's answer for the cancelled request gives it back
                await asyncio.sleep(0.01)
        x = rows(1000, 6)
        later = await asyncio.wait_for(client.infer(Ask("slow", None, x, F32, deadline=None)), 120)
        assert_close(later, numpy_ffn(x, weights), rtol=1e-4)
        assert_close(await asyncio.wait_for(blocker, 120), numpy_ffn(rows(3000, 99), weights), rtol=1e-4)
        assert client.in_flight == 0 and link.arena.free == 2
    finally:
        await client.close()


async def test_no_free_slot_is_overloaded_and_a_slot_is_free_again_once_answered(served: Path) -> None:
    client = EngineClient(served, slots=1)
    try:
        first, second = await asyncio.gather(
            client.infer(Ask("demo", None, rows(2), F32, deadline=None)),
            client.infer(Ask("demo", None, rows(2), F32, deadline=None)),
            return_exceptions=True,
        )
        assert_close(first, demo_reference(rows(2)))
        assert isinstance(second, Overloaded) and second.retry_after_s == 1
        assert_close(await client.infer(Ask("demo", None, rows(2), F32, deadline=None)), demo_reference(rows(2)))
    finally:
        await client.close()


def test_an_answer_is_read_only_under_the_generation_it_was_written_for() -> None:
    front = Arena.create(slots=2, slot_bytes=64)
    engine = Arena.attach(os.dup(front.fd), 2, 64)  # as the engine receives it: a descriptor of its own
    try:
        slot = front.take()
        assert slot is not None
        old = slot.generation
        assert front.answer(slot) is None  # nothing written yet
        front.give_back(slot)
        again = front.take()
        assert again is slot and slot.generation == old + 1
        # A late answer for the slot's earlier request (the engine never writes one, but were it to):
        assert engine.write_answer(slot.place, slot.room, old, [np.arange(4, dtype=np.float32)])
        assert front.answer(slot) is None
        assert engine.write_answer(slot.place, slot.room, slot.generation, [np.full(4, 2.0, np.float32)])
        view = front.answer(slot)
        assert view is not None
        np.testing.assert_array_equal(np.frombuffer(view, np.float32), [2.0] * 4)
        view.release()
        assert not engine.write_answer(
            slot.place, slot.room, slot.generation, [np.zeros(17, np.float32)]
        )  # 68 bytes > 64
    finally:
        engine.close()
        front.close()


async def test_a_connection_without_a_block_of_memory_is_closed_and_a_front_still_served(
    served: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine maps only what a front hands over as it connects: a first byte without a descriptor, or
    a descriptor of something that is not a sealed block of the size HELLO names, ends that connection."""
    loop = asyncio.get_running_loop()

    async def ended(first: bytes, fd: int | None, hello: Hello | None = None) -> bool:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        await loop.sock_connect(sock, str(served))
        if fd is None:
            await loop.sock_sendall(sock, first)
        else:
            socket.send_fds(sock, [first], [fd])
        if hello is not None:
            body = encode([hello])
            await loop.sock_sendall(sock, LENGTH.pack(len(body)) + body)
        try:
            while True:  # a TABLE may come first (after a HELLO), then the end
                if not await asyncio.wait_for(loop.sock_recv(sock, 65536), 30):
                    return True
        finally:
            sock.close()

    assert await ended(b"M", None)  # no descriptor
    other = os.memfd_create("not-a-block", os.MFD_CLOEXEC)  # unsealed
    os.ftruncate(other, Arena.size_of(2, 64))
    assert await ended(b"M", other, Hello(2, 64, 0))
    block = Arena.create(slots=2, slot_bytes=64)
    assert await ended(b"M", block.fd, Hello(4, 64, 0))  # a size other than the block's
    os.close(other)
    block.close()
    assert "a front's connection began without its shared memory" in caplog.text
    assert "not a" in caplog.text
    client = EngineClient(served, slots=2)  # the engine serves on
    try:
        x = rows(2, 5)
        assert_close(await client.infer(Ask("demo", None, x, F32, deadline=None)), demo_reference(x))
    finally:
        await client.close()


# ----- an engine of its own process ------------------------------------------------------------------


@pytest.fixture
def engine_process(tmp_path: Path) -> Iterator[tuple[Path, list[subprocess.Popen[bytes]]]]:
    """Where an engine process listens, and the processes started there (killed at the end)."""
    started: list[subprocess.Popen[bytes]] = []
    yield tmp_path / "engine.sock", started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def start_engine(path: Path, started: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    # A queue deep enough for the long Monte Carlo request below.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")} | {
        "FFN_WARMUP": "0",
        "FFN_MAX_QUEUE_ROWS": "10000000",
    }
    proc = launch(path, env)
    started.append(proc)
    return proc


@pytest.mark.server
async def test_a_killed_engine_fails_what_is_in_flight_and_a_restarted_one_serves(
    engine_process: tuple[Path, list[subprocess.Popen[bytes]]],
) -> None:
    path, started = engine_process
    first = await asyncio.to_thread(start_engine, path, started)
    if hasattr(os, "SCHED_BATCH"):  # woken by a front's frame, it never preempts the front (yield_to_fronts)
        assert os.sched_getscheduler(first.pid) == os.SCHED_BATCH
    client = EngineClient(path)
    try:
        assert_close(await client.infer(Ask("demo", None, rows(2), F32, deadline=None)), demo_reference(rows(2)))
        # Long enough to be in the engine when it is killed: 10,000 passes over 64 rows.
        long = asyncio.create_task(
            client.infer_monte_carlo(
                Ask(
                    "demo",
                    None,
                    rows(64),
                    F32,
                    deadline=None,
                    monte_carlo=MonteCarloRequest(passes=10_000, dropout=0.1, seed=1),
                )
            )
        )
        await asyncio.sleep(0.5)
        first.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(Unavailable, match="engine process ended"):
            await asyncio.wait_for(long, 60)  # it would hang here, had the front not seen the engine go
        print(f"failed {time.monotonic() - killed_at:.3f} s after the kill")
        await asyncio.to_thread(first.wait, 30)  # its listening socket closed with it
        with pytest.raises(Unavailable, match="not running"):  # nothing listens until the restart
            await client.infer(Ask("demo", None, rows(1), F32, deadline=None))
        await asyncio.to_thread(start_engine, path, started)
        x = rows(5, 9)
        assert_close(await client.infer(Ask("demo", None, x, F32, deadline=None)), demo_reference(x))
    finally:
        await client.close()


def test_an_engine_refused_sched_batch_says_so_and_runs_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A sandbox that refuses SCHED_BATCH (a seccomp profile) leaves the default policy, in one log line."""
    if not hasattr(os, "SCHED_BATCH"):
        pytest.skip("this platform has no SCHED_BATCH")
    asked: list[int] = []

    def refuse(pid: int, policy: int, param: os.sched_param) -> None:
        asked.append(policy)
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    with caplog.at_level("INFO", logger="ffn_serve.engine"):
        yield_to_fronts()  # no exception: the engine starts as before
    assert asked == [os.SCHED_BATCH]
    assert "SCHED_BATCH refused (Operation not permitted)" in caplog.text
