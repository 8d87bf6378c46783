"""ModelStreamInfer's messages are read with rooms (app/grpc/stream.py, receive.py), and no room outlives its read.

The service in-process (create_app with its lifespan running) behind a real GrpcServer on 127.0.0.1,
real grpcio clients, and one speaking HTTP/2 frame by frame to leave a message half-sent. With
max_body_bytes 1 MiB and max_held_bytes 4 MiB, streams have two rooms of 1 MiB (half of the
budget) and ModelInfer two of its own. After every case the process's held bytes return to 0 and
the streams' rooms can be taken again; what is waited for is polled
(never timed), answers are checked against numpy.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from app.config.settings import Settings
from app.grpc.receive import STREAM_ROOMS_SHARE
from app.grpc.server import GrpcServer
from app.protocol.admission import HeldBytes, Hold
from bench.hostile_grpc_clients import STREAM_INFER_PATH, slow_messages
from ffn_testing.ports import free_port
from tests.grpc_helpers import D_MODEL, infer_request, output_of, stub
from tests.in_process import InProcessApp
from tests.reference import demo_reference

ROOM = 1 << 20  # max_body_bytes: the room one message on its way takes
PATIENCE_S = 60.0  # how long a poll waits before it fails the test (it returns as soon as what it waits for is so)

StartApp = Callable[..., Awaitable[InProcessApp]]


@dataclass(frozen=True)
class Door:
    held: HeldBytes  # the process's budget, which the rooms are taken from
    target: str
    port: int


@asynccontextmanager
async def serving(start_app: StartApp, read_timeout_s: float = 60.0, held: int = 4 * ROOM) -> AsyncIterator[Door]:
    settings = Settings(max_body_bytes=ROOM, max_held_bytes=held, read_timeout_s=read_timeout_s, warmup=False)
    state = (await start_app(settings)).app.state.service
    port = free_port()
    server = GrpcServer(state, "127.0.0.1", port)
    await server.start()
    try:
        yield Door(state.held, f"127.0.0.1:{port}", port)
    finally:
        await server.stop(0)


@pytest.fixture
async def door(start_app: StartApp) -> AsyncIterator[Door]:
    async with serving(start_app) as opened:
        yield opened


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, D_MODEL)).astype(np.float32)


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait until `condition()` holds (polled); the test fails if it never does within PATIENCE_S."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + PATIENCE_S
    while not condition():
        assert loop.time() < give_up, f"never: {what}"
        await asyncio.sleep(0.01)


def assert_right(answer: pb.ModelStreamInferResponse, x: np.ndarray) -> None:
    assert answer.error_message == "", answer.error_message
    np.testing.assert_allclose(output_of(answer.infer_response), demo_reference(x), rtol=1e-5, atol=1e-5)


async def answered_once(client: service_pb2_grpc.GRPCInferenceServiceStub, seed: int = 0) -> grpc.aio.StreamStreamCall:
    """A stream whose first request is answered right: it now waits for its next message, with a room."""
    call = client.ModelStreamInfer()
    x = rows(2, seed)
    await call.write(infer_request(x, request_id=f"first-{seed}"))
    assert_right(await call.read(), x)
    return call


def stream_rooms_of(door: Door) -> int:
    """How many streams may wait for a message at once: the rooms of the streams' share of the budget (one at least)."""
    return max(1, door.held.limit // STREAM_ROOMS_SHARE // ROOM)


async def all_sent_then_half_closed_all_answered(door: Door, sent: dict[str, np.ndarray]) -> None:
    """One stream carrying every request of `sent` (by id), half-closed: it ends OK with each answered right."""
    async with stub(door.target) as client:
        call = client.ModelStreamInfer()
        for request_id, x in sent.items():
            await call.write(infer_request(x, request_id=request_id))
        await call.done_writing()
        answers = {answer.infer_response.id: answer async for answer in call}
        assert await call.code() == grpc.StatusCode.OK
    assert set(answers) == set(sent)
    for request_id, x in sent.items():
        assert_right(answers[request_id], x)


async def nothing_held_and_both_rooms_free(door: Door) -> None:
    """The budget back to 0, then every stream room (one at least) taken by streams waiting for a message, and
    given back."""
    await until(lambda: door.held.held == 0, f"the budget back to 0 (held: {door.held.held})")
    rooms = stream_rooms_of(door)
    async with stub(door.target) as client:
        calls = [await answered_once(client, seed) for seed in range(rooms)]
        await until(lambda: door.held.held == rooms * ROOM, f"every room taken (held: {door.held.held})")
        for call in calls:
            call.cancel()
    await until(lambda: door.held.held == 0, f"the budget back to 0 (held: {door.held.held})")


async def test_a_stream_waiting_for_its_next_message_holds_one_room_until_it_half_closes(door: Door) -> None:
    async with stub(door.target) as client:
        call = await answered_once(client)
        await until(lambda: door.held.held == ROOM, "the room taken for the next message")
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    await nothing_held_and_both_rooms_free(door)


async def test_half_closed_with_requests_in_flight_every_one_is_answered_and_nothing_stays_held(door: Door) -> None:
    sent = {f"r{i}": rows(1 + 40 * i, seed=i) for i in range(4)}  # up to 240 KiB each
    await all_sent_then_half_closed_all_answered(door, sent)
    await nothing_held_and_both_rooms_free(door)


async def test_a_stream_cancelled_while_it_waits_for_a_message_gives_its_room_back(door: Door) -> None:
    async with stub(door.target) as client:
        call = await answered_once(client)
        await until(lambda: door.held.held == ROOM, "the room taken for the next message")
        call.cancel()
    await nothing_held_and_both_rooms_free(door)


async def test_a_stream_cancelled_with_requests_in_flight_leaves_nothing_held(door: Door) -> None:
    async with stub(door.target) as client:
        call = client.ModelStreamInfer()
        for seed in range(3):
            await call.write(infer_request(rows(200, seed)))  # 400 KiB each: held as they are answered
        call.cancel()
    await nothing_held_and_both_rooms_free(door)


async def test_a_client_gone_in_the_middle_of_a_message_gives_its_room_back(door: Door) -> None:
    # The message declares 512 KiB and sends 10 bytes: the room is held while the rest does not come.
    raw = await slow_messages(door.port, 1, 0.0, declared=512 << 10, path=STREAM_INFER_PATH)
    await until(lambda: door.held.held == ROOM, "the room taken for the half-sent message")
    raw.close()
    await nothing_held_and_both_rooms_free(door)


async def test_streams_left_open_and_quiet_hold_their_own_rooms_not_those_of_unary_calls(door: Door) -> None:
    """Every stream room taken by quiet streams: another stream waits, a ModelInfer call is answered at once."""
    stream_rooms = stream_rooms_of(door)
    async with stub(door.target) as client:
        quiet = [await answered_once(client, seed) for seed in range(stream_rooms)]
        await until(lambda: door.held.held == stream_rooms * ROOM, "every stream room taken by a quiet stream")
        # One more stream, its message sent: no room for its read until the quietest gives its up (with one
        # pool, it would take one of ModelInfer's, and wait again holding it once answered).
        waiting = client.ModelStreamInfer()
        y = rows(2, seed=8)
        await waiting.write(infer_request(y, request_id="after"))
        await asyncio.sleep(0.2)
        x = rows(3, seed=7)
        answer = await asyncio.wait_for(client.ModelInfer(infer_request(x)), PATIENCE_S)
        np.testing.assert_allclose(output_of(answer), demo_reference(x), rtol=1e-5, atol=1e-5)
        await until(lambda: door.held.held == stream_rooms * ROOM, "the waiting stream holding no room")
        quiet[0].cancel()
        assert_right(await asyncio.wait_for(waiting.read(), PATIENCE_S), y)  # the room given back is its own
        for call in (*quiet[1:], waiting):
            call.cancel()
    await nothing_held_and_both_rooms_free(door)


async def test_a_stream_that_gets_no_room_ends_resource_exhausted_with_the_retry_hint(door: Door) -> None:
    others = Hold(door.held)
    others.grow(3 * ROOM + 1)  # what other requests hold: less than a room is left
    async with stub(door.target) as client:
        call = client.ModelStreamInfer()  # its first read is refused, whatever the client sends
        assert await call.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_held_bytes (4194304)" in (await call.details() or "")
        trailers = dict(await call.trailing_metadata() or ())
        assert trailers["ffn-error-type"] == "too_many_bytes_held"
        assert trailers["grpc-retry-pushback-ms"] == "1000"
        assert "x-request-id" in trailers
        assert door.held.held == 3 * ROOM + 1
        others.resize(0)
        again = await answered_once(client, 3)  # a new stream, as a Triton client starts one: answered
        again.cancel()
    await nothing_held_and_both_rooms_free(door)


async def test_a_quiet_stream_is_not_ended_by_time_but_the_quietest_gives_its_room_to_a_call_that_needs_one(
    start_app: StartApp,
) -> None:
    """Both stream rooms held, by half a message never finished and by a stream between its messages: neither is
    ended past read_timeout_s (1 s here); a new stream that finds no room takes the one of the stream quiet longest
    (once QUIET_S has passed), which ends UNAVAILABLE, and the other goes on."""
    async with serving(start_app, read_timeout_s=1.0) as door:
        stream_rooms = stream_rooms_of(door)
        assert stream_rooms == 2
        raw = await slow_messages(door.port, 1, 0.0, declared=512 << 10, path=STREAM_INFER_PATH)
        async with stub(door.target) as client:
            quiet = await answered_once(client)  # then waits for a next message
            await until(lambda: door.held.held == 2 * ROOM, "both stream rooms held")
            await raw.pump(2.5)  # past read_timeout_s: nothing ends by time
            assert not raw.statuses and not raw.closed
            y = rows(2, seed=5)
            await quiet.write(infer_request(y, request_id="again"))
            assert_right(await asyncio.wait_for(quiet.read(), PATIENCE_S), y)  # quiet, not ended: it serves
            # A new stream: no room free, so the stream quiet longest (the half-sent message's) gives its up.
            newcomer = await answered_once(client, 9)
            while not raw.statuses and not raw.closed:
                await raw.pump(1.0)
            assert raw.statuses == [str(grpc.StatusCode.UNAVAILABLE.value[0])]
            z = rows(3, seed=6)
            await quiet.write(infer_request(z, request_id="still"))
            assert_right(await asyncio.wait_for(quiet.read(), PATIENCE_S), z)  # the other went on
            newcomer.cancel()
            quiet.cancel()
        raw.close()
        await nothing_held_and_both_rooms_free(door)


async def test_a_quiet_stream_asked_for_its_room_ends_unavailable_saying_to_start_a_new_one(door: Door) -> None:
    stream_rooms = stream_rooms_of(door)
    async with stub(door.target) as client:
        quiet = [await answered_once(client, seed) for seed in range(stream_rooms)]
        newcomer = await answered_once(client, 99)  # waits until the first is quiet (QUIET_S), then takes its room
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(quiet[0].read(), PATIENCE_S)
        assert await quiet[0].code() == grpc.StatusCode.UNAVAILABLE
        assert "gave its room to another call; start a new stream" in (await quiet[0].details() or "")
        trailers = dict(await quiet[0].trailing_metadata() or ())
        assert trailers["ffn-error-type"] == "unavailable" and trailers["grpc-retry-pushback-ms"] == "1000"
        for call in (*quiet[1:], newcomer):
            call.cancel()
    await nothing_held_and_both_rooms_free(door)


async def test_with_one_room_for_the_whole_budget_a_stream_waits_for_its_answers_before_each_read(
    start_app: StartApp,
) -> None:
    # max_held_bytes = max_body_bytes: a room and any request held pass the budget, so the stream, refused a room
    # while its own requests hold bytes, waits for their answers and asks again, instead of ending.
    sent = {f"r{i}": rows(1 + 100 * i, seed=i) for i in range(3)}
    async with serving(start_app, held=ROOM) as door:
        await all_sent_then_half_closed_all_answered(door, sent)
        await nothing_held_and_both_rooms_free(door)


async def test_a_message_that_does_not_parse_is_answered_and_the_stream_goes_on_holding_nothing(door: Door) -> None:
    x = rows(2, 5)
    async with grpc.aio.insecure_channel(door.target) as channel:
        call = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )()  # requests as raw bytes
        await call.write(b"\xff\xff\xff")
        await call.write(infer_request(x, request_id="after").SerializeToString())
        await call.done_writing()
        answers = [answer async for answer in call]
        assert await call.code() == grpc.StatusCode.OK
    assert answers[0].error_message.startswith("malformed protobuf")
    assert answers[0].infer_response.parameters["error_type"].string_param == "invalid_input"
    assert answers[1].infer_response.id == "after"
    assert_right(answers[1], x)
    await nothing_held_and_both_rooms_free(door)
