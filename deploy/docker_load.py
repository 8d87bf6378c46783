"""Load that counts every request, for deploy/docker_check.py: no retry, actions run midway.

Keep-alive clients (ffn_client.losses: never a retry, which would hide a loss) send while a
thread runs the check's actions one after another (stop a container, kill one...), each once
`settle` more requests have been answered since the one before: every action meets live load.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from deploy.docker_tools import CheckFailed
from ffn_client.http1 import build_request
from ffn_client.losses import Fates, keep_alive_clients

Action = tuple[str, Callable[[], Any]]  # a name for the report, and what to do


def transform_request(model: str, d_model: int, rows: int = 4) -> bytes:
    """A kept-alive raw-binary transform request of `rows` rows."""
    x = np.random.default_rng(3).standard_normal((rows, d_model)).astype(np.float32)
    headers = {
        "Content-Type": "application/octet-stream",
        "Accept": "application/octet-stream",
        "X-Shape": f"{rows},{d_model}",
        "X-Dtype": "float32",
    }
    return build_request("POST", f"/v1/models/{model}/transform", headers, x.tobytes(), host="ffn")


def load_during(
    port: int,
    request: bytes,
    actions: Sequence[Action],
    *,
    clients: int,
    settle: int,
    stop_when_refused: bool,
    limit_s: float = 900,
) -> tuple[Fates, dict[str, Any]]:
    """Clients on 127.0.0.1:`port` while `actions` run; the fates, and what each action returned.

    The load stops once the last action has returned (append a no-op action to see the load go on
    after it), or, with `stop_when_refused`, when every client has found the port closed.
    """
    done: dict[str, Any] = {}
    failed: list[BaseException] = []
    fates_seen: list[Fates] = []

    async def run() -> Fates:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def act() -> None:
            try:
                deadline = time.monotonic() + limit_s
                for name, action in actions:
                    target = (fates_seen[0].sent if fates_seen else 0) + settle
                    while not fates_seen or fates_seen[0].sent < target:
                        if time.monotonic() > deadline:
                            raise CheckFailed(f"the load stalled before {name}: {_counts(fates_seen)}")
                        time.sleep(0.05)
                    started = time.perf_counter()
                    done[name] = {"result": action(), "s": round(time.perf_counter() - started, 1)}
            except BaseException as exc:  # reported by the caller, after the load stops
                failed.append(exc)
            finally:
                loop.call_soon_threadsafe(stop.set)

        def seen(fates: Fates) -> None:
            if not fates_seen:
                fates_seen.append(fates)

        thread = threading.Thread(target=act, name="docker-check-actions", daemon=True)
        thread.start()
        fates = await keep_alive_clients(
            "127.0.0.1",
            port,
            request,
            clients=clients,
            stop=stop,
            stop_when_refused=stop_when_refused,
            on_answer=seen,
        )
        await asyncio.to_thread(thread.join, limit_s)
        return fates

    fates = asyncio.run(run())
    if failed:
        raise CheckFailed(f"{type(failed[0]).__name__}: {failed[0]} (load so far: {fates.to_dict()})")
    if len(done) != len(actions):
        raise CheckFailed(f"the load ended before its actions ran: {fates.to_dict()}, done: {list(done)}")
    return fates, done


def _counts(fates_seen: list[Fates]) -> dict[str, object]:
    return fates_seen[0].to_dict() if fates_seen else {"sent": 0}
