"""One model state, read alike by every surface: health, model readiness, /v1/models, the V2 repository
index, the statistics, the metrics and the infer routes themselves.

The model is put in each state by real events: its warm-up held on the device thread (LOADING), let go
(READY), its batcher killed (UNAVAILABLE, with why), and the server draining (UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest

from app.config.settings import ModelSpec, Settings
from app.engine.errors import Unavailable
from app.engine.runner import ModelRunner
from app.engine.service import _outcome
from app.main import create_app
from ffn_testing import metric_value
from tests.in_process import BASE_URL

STATES = ("LOADING", "READY", "UNAVAILABLE")
ROW = {"inputs": [[0.5] * 512]}


@dataclass
class Held:
    client: httpx.AsyncClient
    engine: object
    warm: threading.Event


@pytest.fixture
async def held(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Held]:
    """Two demo-sized models; the second's warm-up waits on `warm` (set by the test)."""
    warm, waiting = threading.Event(), threading.Event()
    real_warm_up = ModelRunner.warm_up
    calls = 0

    def warm_up_the_second_when_told(runner: ModelRunner) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 2:
            waiting.set()
            assert warm.wait(120), "the test never let the warm-up go"
        return real_warm_up(runner)

    monkeypatch.setattr(ModelRunner, "warm_up", warm_up_the_second_when_told)
    settings = Settings(max_batch_rows=8, models=[ModelSpec(name="first"), ModelSpec(name="second")])
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE_URL) as client:
            assert await asyncio.to_thread(waiting.wait, 120)
            yield Held(client, app.state.service.engine, warm)
            warm.set()


async def surfaces(client: httpx.AsyncClient, model: str) -> dict[str, object]:
    """What each surface says of `model` (and of the server)."""
    listed = {m["name"]: m for m in (await client.get("/v1/models")).json()["models"]}[model]
    index = {m["name"]: m for m in (await client.post("/v2/repository/index")).json()}[model]
    page = (await client.get("/metrics")).text
    stats = (await client.get(f"/v2/models/{model}/stats")).json()["model_stats"]
    model_ready = await client.get(f"/v2/models/{model}/ready")
    infer = await client.post(f"/v1/models/{model}/transform", json=ROW)
    return {
        "server_ready": (await client.get("/v2/health/ready")).status_code,
        "model_ready": model_ready.status_code,
        "listed": (listed["state"], listed["ready"], listed["reason"]),
        "index": (index["state"], index["reason"]),
        "metric": {state: metric_value(page, "ffn_model_state", model=model, state=state) for state in STATES},
        "stats_listed": [s["name"] for s in stats],
        "infer": infer.status_code,
        "errors": [r.json()["error"] for r in (model_ready, infer) if r.status_code != 200],
    }


def one_hot(state: str) -> dict[str, float]:
    return {s: float(s == state) for s in STATES}


async def test_loading_then_ready(held: Held) -> None:
    # "first" is warm; "second" is held in its warm-up.
    seen = await surfaces(held.client, "second")
    assert seen | {"errors": None} == {
        "server_ready": 503,
        "model_ready": 503,
        "listed": ("LOADING", False, "warming up"),
        "index": ("LOADING", "warming up"),
        "metric": one_hot("LOADING"),
        "stats_listed": ["second"],
        "infer": 503,
        "errors": None,
    }
    assert all("warming up" in error for error in seen["errors"])  # type: ignore[attr-defined]
    # (Not infer on "first" here: the device thread it shares with "second" is held by the warm-up.)
    listed = {m["name"]: m["state"] for m in (await held.client.get("/v1/models")).json()["models"]}
    assert listed == {"first": "READY", "second": "LOADING"}

    held.warm.set()
    while (await held.client.get("/v2/health/ready")).status_code != 200:
        await asyncio.sleep(0.01)
    assert await surfaces(held.client, "second") == {
        "server_ready": 200,
        "model_ready": 200,
        "listed": ("READY", True, ""),
        "index": ("READY", ""),
        "metric": one_hot("READY"),
        "stats_listed": ["second"],
        "infer": 200,
        "errors": [],
    }


async def test_a_dead_batcher_is_unavailable_everywhere_with_why(held: Held) -> None:
    held.engine.model("first")._batcher._collector.cancel()  # type: ignore[attr-defined]  # dies, not stopped
    await asyncio.sleep(0.05)
    seen = await surfaces(held.client, "first")
    reason = "the batcher stopped unexpectedly: cancelled"
    assert seen == {
        "server_ready": 503,
        "model_ready": 503,
        "listed": ("UNAVAILABLE", False, reason),
        "index": ("UNAVAILABLE", reason),
        "metric": one_hot("UNAVAILABLE"),
        "stats_listed": ["first"],
        "infer": 503,
        "errors": [f"model 'first' is not ready: {reason}"] * 2,
    }
    ready = (await held.client.get("/v2/health/ready")).json()["error"]
    assert f"model 'first': {reason}" in ready
    only_ready = (await held.client.post("/v2/repository/index", json={"ready": True})).json()
    assert only_ready == []  # first is unavailable, second still loading


async def test_draining_is_unavailable_everywhere(held: Held) -> None:
    held.warm.set()
    while (await held.client.get("/v2/health/ready")).status_code != 200:
        await asyncio.sleep(0.01)
    assert await held.engine.drain() is True  # type: ignore[attr-defined]
    for model in ("first", "second"):
        seen = await surfaces(held.client, model)
        assert seen["listed"] == ("UNAVAILABLE", False, "draining before shutdown")
        assert seen["index"] == ("UNAVAILABLE", "draining before shutdown")
        assert seen["metric"] == one_hot("UNAVAILABLE")
        assert (seen["server_ready"], seen["model_ready"], seen["infer"]) == (503, 503, 503)


@pytest.mark.parametrize("body", [{"ready": 0}, {"ready": 1}, {"ready": "yes"}, {"ready": "true"}, {"ready": None}])
async def test_the_repository_index_takes_only_a_boolean(held: Held, body: dict) -> None:
    r = await held.client.post("/v2/repository/index", json=body)
    assert r.status_code == 400 and r.json()["error_type"] == "invalid_input", r.text
    assert "ready" in r.json()["error"]


def test_a_control_that_reached_no_process_is_unavailable_not_a_crash() -> None:
    # The supervisor answers a broadcast with no replies when no process that would apply it had a
    # pipe by then; reading the version from the first reply raised IndexError (a 500).
    with pytest.raises(Unavailable, match="load of model 'm' reached no serving process"):
        _outcome("m", "load", [])


async def test_an_unknown_models_404_names_the_nearest_served_one(start_app) -> None:
    # Issue 41: a typo got "is not served here" and nothing more.
    client = (await start_app(Settings(max_batch_rows=8))).client
    typo = await client.post("/v1/models/dmeo/transform", json={"inputs": [[0.0] * 512]})
    assert typo.status_code == 404
    assert typo.json()["error"].startswith("model 'dmeo' is not served here; did you mean 'demo'?")
    far = await client.get("/v2/models/bert-large")
    assert far.status_code == 404 and "did you mean" not in far.json()["error"]
