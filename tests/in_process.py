"""The service in-process: create_app(settings) with its lifespan running, and an httpx client on it.

No sockets: httpx.ASGITransport calls the app directly. Used through conftest's `start_app`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI

from app.config.settings import Settings
from app.main import create_app
from ffn_testing import StartPatience

BASE_URL = "http://ffn.test"


@dataclass(frozen=True)
class InProcessApp:
    app: FastAPI
    client: httpx.AsyncClient


@asynccontextmanager
async def serve_in_process(
    settings: Settings, *, ready_timeout: float = 60.0, fast_path: bool = True
) -> AsyncIterator[InProcessApp]:
    """The app, running and ready, for the block; the test fails if it is not ready within
    `ready_timeout` seconds of this process's CPU time (its start and warm-up run here; StartPatience)."""
    app = create_app(settings, fast_path=fast_path)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL, timeout=30.0) as client:
            await _until_ready(client, ready_timeout)
            yield InProcessApp(app, client)


async def _until_ready(client: httpx.AsyncClient, timeout: float) -> None:
    # Warm-up runs in the background after the lifespan starts; readiness is what gates requests.
    patience = StartPatience(time.process_time, timeout)
    while (status := (await client.get("/v2/health/ready")).status_code) != 200:
        reason = patience.exhausted()
        if reason is not None:
            pytest.fail(f"the in-process app was {reason} (last /v2/health/ready: {status})")
        await asyncio.sleep(0.01)
