"""A lean request's large body read straight into its buffer (app/http/transport/direct_body.py).

In-process servers on 127.0.0.1, real sockets, on asyncio's loop and on uvloop's: the body's rest
is read through a DirectBody (the tests count them), in any cut; the answers equal numpy's FFN; the connection's next request is
read by the parser; a hang-up, a stalled body and bytes sent after a refusal are handled as they
are without it, and every byte held is given back. tests/test_lean.py sends the same large bodies
to a server with the lean path off and compares the answers.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
import numpy as np
import pytest
import uvloop

from app.config.settings import Settings
from app.http.transport import direct_body
from app.http.transport.direct_body import DIRECT_BODY_BYTES
from ffn_client.http1 import read_response
from ffn_testing import http_request
from tests.reference import assert_close, demo_reference
from tests.test_lean import V1, D, serving
from tests.wire import raw_headers

ROWS = 8 * DIRECT_BODY_BYTES // (4 * D) + 5  # a body of 8 times the size read directly: past any one read of the loop


# Each test runs on asyncio's own loop and on uvloop's (the server's): each switches a transport's
# protocol its own way.
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def on_each_loop(scenario: Callable[[list[int]], Coroutine[Any, Any, None]]) -> Callable[[str, list[int]], None]:
    """The test that runs `scenario` (given the `direct` fixture) on each loop of LOOPS."""

    @pytest.mark.parametrize("loop", LOOPS)
    def test(loop: str, direct: list[int]) -> None:
        with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
            runner.run(scenario(direct))

    test.__doc__ = scenario.__doc__
    return test


@pytest.fixture
def direct(monkeypatch) -> list[int]:
    """The total length of each body a DirectBody was made for."""
    made: list[int] = []
    init = direct_body.DirectBody.__init__

    def recording(self, owner, received, total: int) -> None:
        made.append(total)
        init(self, owner, received, total)

    monkeypatch.setattr(direct_body.DirectBody, "__init__", recording)
    return made


PLAIN = {"accept-encoding": "identity"}  # httpx's default asks for a compressed answer: the full path's


def _rows(seed: int, rows: int = ROWS) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, D)).astype(np.float32)


async def _write(writer: asyncio.StreamWriter, pieces: list[bytes]) -> None:
    for piece in pieces:
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(0.01)


@on_each_loop
async def test_a_large_body_in_any_cut_is_read_into_its_buffer_and_the_next_request_read_right(
    direct: list[int],
) -> None:
    cases = [_rows(seed) for seed in range(4)]
    async with serving(Settings(max_batch_rows=1024)) as (port, app):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answers = []
        for index, rows in enumerate(cases):
            message = http_request("POST", V1, raw_headers(rows.shape), rows.tobytes(), close=False)
            head_end = message.index(b"\r\n\r\n") + 4
            if index == 0:  # the head alone: the whole body is read directly
                pieces = [message[:head_end], message[head_end:]]
            elif index == 1:  # the head with a few body bytes, then the rest in uneven parts cut inside rows
                cuts = [0, head_end + 5, head_end + 70_001, head_end + 200_003, len(message)]
                pieces = [message[a:b] for a, b in itertools.pairwise(cuts)]
            elif index == 2:  # the head and a body's first part, then the body's last byte alone
                pieces = [
                    message[: head_end + DIRECT_BODY_BYTES],
                    message[head_end + DIRECT_BODY_BYTES : -1],
                    message[-1:],
                ]
            else:  # the body, then the next request's head in the same write: the read stops at the body's end
                pieces = [message[:head_end], message[head_end:] + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"]
            await _write(writer, pieces)
            async with asyncio.timeout(30):
                answers.append(await read_response(reader))
        async with asyncio.timeout(30):
            live = await read_response(reader)
        writer.close()
        held = app.state.service.held.held
    for rows, answer in zip(cases, answers, strict=True):
        assert answer.status == 200, answer.body[:200]
        assert_close(np.frombuffer(answer.body, np.float32).reshape(rows.shape), demo_reference(rows))
    assert live.status == 200
    assert direct == [rows.nbytes for rows in cases]  # each read directly, at its declared length
    assert held == 0


@on_each_loop
async def test_a_bad_large_body_read_directly_is_refused_as_any_other(direct: list[int]) -> None:
    rows = _rows(5)
    with_nan = rows.copy()
    with_nan[-1, -1] = np.nan
    async with serving(Settings(max_batch_rows=1024)) as (port, app):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=PLAIN) as client:
            nan = await client.post(V1, content=with_nan.tobytes(), headers=raw_headers(rows.shape))
            short = await client.post(V1, content=rows[:-1].tobytes(), headers=raw_headers(rows.shape))
            right = await client.post(V1, content=rows.tobytes(), headers=raw_headers(rows.shape))
        held = app.state.service.held.held
    assert nan.status_code == 400 and nan.json()["error_type"] == "invalid_input"
    assert "finite" in nan.json()["error"]
    assert short.status_code == 400 and short.json()["error_type"] == "invalid_input"
    assert right.status_code == 200
    assert_close(np.frombuffer(right.content, np.float32).reshape(rows.shape), demo_reference(rows))
    assert len(direct) == 3  # httpx writes the head apart: each body is read directly from the start
    assert held == 0


@on_each_loop
async def test_a_client_that_hangs_up_during_a_direct_read_gives_back_what_it_held(direct: list[int]) -> None:
    rows = _rows(6)
    async with serving(Settings(max_batch_rows=1024)) as (port, app):
        message = http_request("POST", V1, raw_headers(rows.shape), rows.tobytes(), close=False)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        await _write(writer, [message[: len(message) // 2]])
        state = app.state.service
        async with asyncio.timeout(30):
            while not direct or state.held.held != rows.nbytes:
                await asyncio.sleep(0.01)
        writer.close()
        async with asyncio.timeout(30):
            while state.held.held:
                await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=PLAIN) as client:
            metrics = (await client.get("/metrics")).text
            after = await client.post(V1, content=rows.tobytes(), headers=raw_headers(rows.shape))
    assert 'ffn_requests_total{model="demo",outcome="client_closed_request",protocol="http"} 1.0' in metrics
    assert after.status_code == 200
    assert_close(np.frombuffer(after.content, np.float32).reshape(rows.shape), demo_reference(rows))


@on_each_loop
async def test_a_body_that_stalls_during_a_direct_read_gets_408_and_what_follows_is_discarded(
    direct: list[int],
) -> None:
    rows = _rows(7)
    async with serving(Settings(max_batch_rows=1024, read_timeout_s=1.0)) as (port, app):
        message = http_request("POST", V1, raw_headers(rows.shape), rows.tobytes(), close=False)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await _write(writer, [message[: len(message) // 3]])
        async with asyncio.timeout(30):
            refused = await read_response(reader)
        # The rest arrives after the answer: read into the spare buffer and discarded, never a request.
        writer.write(message[len(message) // 3 :])
        await writer.drain()
        async with asyncio.timeout(30):
            assert await reader.read(-1) == b""  # closed once it lingered, with no second answer
        writer.close()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=PLAIN) as client:
            after = await client.post(V1, content=rows.tobytes(), headers=raw_headers(rows.shape))
        held = app.state.service.held.held
    assert refused.status == 408, refused.body[:200]
    assert b"request_timeout" in refused.body
    assert len(direct) == 2  # the stalled body and the one after it were both read directly
    assert after.status_code == 200
    assert_close(np.frombuffer(after.content, np.float32).reshape(rows.shape), demo_reference(rows))
    assert held == 0
