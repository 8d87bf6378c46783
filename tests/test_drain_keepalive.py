"""The end of a drain loses no request on a kept-alive connection.

Clients that keep their connection open and send in a loop, never retrying: when the process
exits, a connection still open is closed under the request its client has just written, which
is lost (before the fix, 8 of 8 clients lost one, every run). So while draining, every answer
says `Connection: close`, and idle connections are closed once quiet: each request written gets
an answer (200 or 503); after the exit, connects are refused, and nothing was written.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest

from ffn_client.http1 import build_request, read_response
from ffn_client.losses import Fates, keep_alive_clients
from ffn_testing import HOST, ServerProcess, metric_value, start_server, wait_for_metrics
from tests.slow_model import slow_model_config
from tests.wire import raw_headers

pytestmark = pytest.mark.server  # every test here starts a real ffn-serve

D_MODEL = 512
CLIENTS = 8
SLOW_ROWS = 3072


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("keepalive-drain")
    return slow_model_config(
        folder, f"warmup = false\nmax_batch_rows = {SLOW_ROWS}\ndrain_timeout_s = 30", with_demo=True
    )


def transform_request(model: str, rows: int) -> bytes:
    """A kept-alive raw-binary transform request (no Connection header: HTTP/1.1 keeps it open)."""
    x = np.ones((rows, D_MODEL), np.float32)
    return build_request("POST", f"/v1/models/{model}/transform", raw_headers(x.shape), x.tobytes(), host=f"{HOST}")


@pytest.mark.parametrize("workers", [1, 2])
async def test_sigterm_answers_every_request_written_on_kept_alive_connections(config: Path, workers: int) -> None:
    with start_server(config=config, env={"FFN_WORKERS": str(workers)}) as server:
        if workers > 1:  # ready answers once one worker is: a signal while another still starts is another test
            await _all_workers_ready(server, workers)
        stop = asyncio.Event()
        flowing = asyncio.Event()

        def note(fates: Fates) -> None:
            if fates.answered[200] >= 40:
                flowing.set()

        clients = asyncio.create_task(
            keep_alive_clients(
                HOST, server.port, transform_request("demo", 2), clients=CLIENTS, stop=stop, on_answer=note
            )
        )
        try:
            await asyncio.wait_for(flowing.wait(), 120)
            # A slow request computing when the signal comes: the drain lasts at least the rest of its
            # pass, and its answer, though accepted before the drain, must close its connection too.
            reader, writer = await asyncio.open_connection(HOST, server.port)
            writer.write(transform_request("slow", SLOW_ROWS))
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as probe:
                await wait_for_metrics(
                    probe,
                    lambda m: metric_value(m, "ffn_queue_seconds_count", model="slow") == 1,
                    "the slow request's pass started",
                )
            server.terminate()
            slow = await asyncio.wait_for(read_response(reader), 120)
            writer.close()
            fates = await asyncio.wait_for(clients, 120)  # each client ends at its first refused connect
        finally:
            stop.set()
            if not clients.done():
                clients.cancel()
        code = server.wait(60)

    assert code == 0, server.logs()
    assert slow.status == 200 and not slow.keep_alive, (slow.status, slow.headers)
    assert fates.lost == [], fates.to_dict()
    assert set(fates.answered) <= {200, 503}, fates.to_dict()
    assert fates.closing[503] == fates.answered[503], "every 503 of the drain closes its connection"
    assert fates.refused == CLIENTS, fates.to_dict()


async def _all_workers_ready(server: ServerProcess, workers: int) -> None:
    """Wait (up to 180 s, for a loaded machine) for the supervisor's line saying every worker is ready."""
    line = f"ready: {workers} workers"
    async with asyncio.timeout(180):
        while line not in server.logs():
            await asyncio.sleep(0.2)
