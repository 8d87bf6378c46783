"""Explicit model control in one process: load, reload and unload while serving, and every way a load fails.

The weights are files the tests write and replace; every answer is checked against the float64
numpy FFN of the weights the test wrote (tests/model_files.py), and V2 answers carry the version
that computed them. Worker processes, SIGHUP and tritonclient are in test_model_control_workers.py
and test_tritonclient.py.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import threading
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from app.config.settings import load_settings
from app.config.settings_problems import SettingsError
from app.engine import lifecycle
from app.engine.runner import ModelRunner
from ffn_testing import metric_value
from tests.in_process import InProcessApp
from tests.model_files import matches, write_ffn
from tests.reference import assert_close, demo_reference

D = 16
StartApp = Callable[..., Awaitable[InProcessApp]]


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """A model repository folder holding the config file: model `m` from a.safetensors, `other` the demo."""
    folder = tmp_path / "repository"
    folder.mkdir()
    (folder / "ffn.toml").write_text(
        'max_batch_rows = 16\n\n[[models]]\nname = "m"\nweights = "a.safetensors"\n\n[[models]]\nname = "other"\n'
    )
    return folder


async def serve(start_app: StartApp, repository: Path, **settings: Any) -> InProcessApp:
    return await start_app(load_settings(config=repository / "ffn.toml", **{"model_control": "explicit", **settings}))


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)


async def infer(client: httpx.AsyncClient, x: np.ndarray, path: str = "/v2/models/m/infer") -> tuple[np.ndarray, str]:
    """A V2 JSON infer: the output and the model_version that answered."""
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    return np.asarray(answer["outputs"][0]["data"], dtype=np.float64).reshape(x.shape), answer["model_version"]


async def load(client: httpx.AsyncClient, name: str = "m", config: dict[str, Any] | None = None) -> httpx.Response:
    body = {} if config is None else {"parameters": {"config": json.dumps(config)}}
    return await client.post(f"/v2/repository/models/{name}/load", json=body)


async def metric(client: httpx.AsyncClient, name: str, **labels: str) -> float:
    return metric_value((await client.get("/metrics")).text, name, **labels)


# ----- off by default -----------------------------------------------------------------------------


async def test_with_model_control_none_load_and_unload_are_a_400_naming_the_setting(
    start_app: StartApp, repository: Path
) -> None:
    a = write_ffn(repository / "a.safetensors", 1, d_model=D)
    service = await start_app(load_settings(config=repository / "ffn.toml"))
    for action in ("load", "unload"):
        response = await service.client.post(f"/v2/repository/models/m/{action}")
        assert response.status_code == 400
        assert response.json()["error_type"] == "model_control_off"
        assert "model_control" in response.json()["error"] and "--model-control explicit" in response.json()["error"]
    assert "model_repository" not in (await service.client.get("/v2")).json()["extensions"]
    assert await metric(service.client, "ffn_model_loads_total", model="m", outcome="failed") == 1  # the refused load
    y, version = await infer(service.client, rows(2, 0))
    assert matches(y, a, rows(2, 0)) and version == "1"


# ----- reload ---------------------------------------------------------------------------------------


async def test_replacing_the_file_then_loading_changes_the_answers_and_the_version(
    start_app: StartApp, repository: Path
) -> None:
    a = write_ffn(repository / "a.safetensors", 1, d_model=D)
    service = await serve(start_app, repository)
    client, x = service.client, rows(3, 1)
    assert "model_repository" in (await client.get("/v2")).json()["extensions"]
    y, version = await infer(client, x)
    assert matches(y, a, x) and version == "1"

    b = write_ffn(repository / "a.safetensors", 2, d_model=D)
    y, version = await infer(client, x)
    assert matches(y, a, x) and version == "1", "a replaced file changes nothing until it is loaded"
    response = await load(client)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["name"] == "m" and answer["version"] == 2
    (worker,) = answer["workers"]
    assert worker["worker"] == 0 and worker["version"] == 2
    assert all(worker[f"{step}_s"] >= 0 for step in ("read", "build", "warm_up", "switch", "retire"))

    y, version = await infer(client, x)
    assert matches(y, b, x) and not matches(y, a, x) and version == "2"
    assert (await client.get("/v2/models/m")).json()["versions"] == ["2"]
    (listed,) = [m for m in (await client.get("/v1/models")).json()["models"] if m["name"] == "m"]
    assert listed["version"] == 2 and listed["state"] == "READY"
    assert (await client.get("/v2/models/m/stats")).json()["model_stats"][0]["version"] == "2"
    assert (await client.get("/v2/models/m/versions/2/ready")).status_code == 200
    old = await client.post("/v2/models/m/versions/1/infer", json={"inputs": []})
    assert old.status_code == 404 and "the version served is 2" in old.json()["error"]
    y, version = await infer(client, x, "/v2/models/m/versions/2/infer")
    assert matches(y, b, x) and version == "2"
    assert await metric(client, "ffn_model_version", model="m") == 2
    assert await metric(client, "ffn_model_loads_total", model="m", outcome="ok") == 1
    assert await metric(client, "ffn_model_load_seconds_count", model="m") == 1


async def test_requests_admitted_before_a_reload_finish_on_the_old_copy_and_readiness_never_drops(
    start_app: StartApp, repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = write_ffn(repository / "a.safetensors", 1, d_model=D)
    service = await serve(start_app, repository)
    client, engine = service.client, service.app.state.service.engine
    old = engine.model("m")
    entered, release = threading.Event(), threading.Event()
    forward = old._batcher._forward

    def held(parts: Any) -> Any:  # the old copy's forward pass waits until the test lets it go
        entered.set()
        assert release.wait(60), "the test never let the forward pass go"
        return forward(parts)

    old._batcher._forward = held
    old._batcher.inline_rows = 0  # on the model thread: held there, it does not hold the event loop
    warming, warm = threading.Event(), threading.Event()
    warm_up = ModelRunner.warm_up

    def held_warm_up(runner: ModelRunner) -> list[int]:  # the new copy's warm-up waits too
        warming.set()
        assert warm.wait(60), "the test never let the warm-up go"
        return warm_up(runner)

    monkeypatch.setattr(ModelRunner, "warm_up", held_warm_up)
    not_ready: list[int] = []

    async def watch_readiness() -> None:  # the endpoint and the gauge, both read the model's one state
        while True:
            status = (await client.get("/v2/models/m/ready")).status_code
            if status != 200:
                not_ready.append(status)
            if await metric(client, "ffn_model_state", model="m", state="READY") != 1:
                not_ready.append(0)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch_readiness())
    try:
        x1, x2 = rows(2, 11), rows(3, 12)
        first = asyncio.create_task(infer(client, x1))
        assert await asyncio.to_thread(entered.wait, 60)
        b = write_ffn(repository / "a.safetensors", 2, d_model=D)
        loading = asyncio.create_task(load(client))
        assert await asyncio.to_thread(warming.wait, 60)  # built beside the serving copy, warming up
        assert (await client.get("/v2/models/m/ready")).status_code == 200
        assert await metric(client, "ffn_model_state", model="m", state="READY") == 1
        assert await metric(client, "ffn_model_state", model="m", state="LOADING") == 0
        warm.set()
        while engine.model("m") is old:  # the new copy is warm: it takes the old one's place
            await asyncio.sleep(0.005)
        second = asyncio.create_task(infer(client, x2))  # admitted to the new copy
        await asyncio.sleep(0.05)
        assert not loading.done(), "the load answers once the old copy has finished what it admitted"
        release.set()
        (y1, v1), (y2, v2), response = await asyncio.gather(first, second, loading)
    finally:
        release.set()
        warm.set()
        watcher.cancel()
    assert response.status_code == 200, response.text
    assert matches(y1, a, x1) and v1 == "1"
    assert matches(y2, b, x2) and v2 == "2"
    assert not_ready == []


@pytest.mark.parametrize("route", ["v2", "native"])
async def test_a_request_whose_body_arrives_during_a_reload_is_answered_by_the_new_copy(
    start_app: StartApp, repository: Path, route: str
) -> None:
    """Looked up before its body arrived, computed after the swap: the copy it meets is the one serving then."""
    write_ffn(repository / "a.safetensors", 1, d_model=D)
    service = await serve(start_app, repository)
    x = rows(2, 13)
    if route == "v2":
        path, document = "/v2/models/m/infer", {"inputs": [{"name": "input", "shape": [2, D], "datatype": "FP32"}]}
        document["inputs"][0]["data"] = x.ravel().tolist()
    else:
        path, document = "/v1/models/m/transform", {"inputs": x.tolist()}
    body = json.dumps(document).encode()
    reading, go_on = asyncio.Event(), asyncio.Event()

    async def slowly() -> Any:
        yield body[:10]
        reading.set()  # the route has looked the model up and waits for the rest of the body
        await go_on.wait()
        yield body[10:]

    sending = asyncio.create_task(
        service.client.post(path, content=slowly(), headers={"content-type": "application/json"})
    )
    await reading.wait()
    b = write_ffn(repository / "a.safetensors", 2, d_model=D)
    assert (await load(service.client)).status_code == 200  # the copy it looked up is retired and stopped
    go_on.set()
    response = await sending
    assert response.status_code == 200, response.text
    if route == "v2":
        answer = response.json()
        y = np.asarray(answer["outputs"][0]["data"]).reshape(x.shape)
        assert answer["model_version"] == "2"
    else:
        y = np.asarray(response.json()["outputs"])
    assert matches(y, b, x)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch-invariant"])
async def test_a_reloaded_copy_is_freed_even_after_gc_freeze(
    start_app: StartApp, repository: Path, batch_invariant: bool
) -> None:
    """The server calls gc.freeze() once loaded: the collector never visits what it froze, so the
    old copy must be freed by its last reference going, with no cycle left to keep it."""
    write_ffn(repository / "a.safetensors", 1, d_model=D)
    service = await serve(start_app, repository, batch_invariant=batch_invariant)
    loop = asyncio.get_running_loop()
    freed = asyncio.Event()
    old = service.app.state.service.engine.model("m")
    weakref.finalize(old._model, loop.call_soon_threadsafe, freed.set)
    del old
    gc.collect()
    gc.freeze()
    try:
        write_ffn(repository / "a.safetensors", 2, d_model=D)
        assert (await load(service.client)).status_code == 200
        await asyncio.wait_for(freed.wait(), 30)
    finally:
        gc.unfreeze()


# ----- load with a config parameter, and the repository's walls --------------------------------------


async def test_a_load_of_a_name_no_table_names_is_refused_before_any_copy_is_built(
    start_app: StartApp, repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28 class 7: a load of any new name with `config {}` built a copy of the demo weights
    (about 10 MiB each, without bound: python3 -m bench.model_loads). The models are the configuration's, as Triton's are its
    repository's: a name no [[models]] table names is refused, weights named or not, before any
    worker reads a file, and it leaves no entry in the index and no series in /metrics."""
    write_ffn(repository / "a.safetensors", 1, d_model=D)
    write_ffn(repository / "b.safetensors", 2, d_model=D)
    service = await serve(start_app, repository)
    client = service.client
    reads: list[str] = []
    read = lifecycle.read_weights
    monkeypatch.setattr(lifecycle, "read_weights", lambda spec, path=None: reads.append(spec.name) or read(spec, path))
    attempts = [(f"made-up-{i}", {}) for i in range(20)]
    attempts += [("extra", {"weights": "b.safetensors", "format": "native"}), ("extra", None)]
    for name, config in attempts:
        response = await load(client, name, config)
        assert response.status_code == 400 and response.json()["error_type"] == "load_failed", response.text
        assert response.json()["error"] == (
            f"no model {name!r} to load: no [[models]] table of the config file {repository / 'ffn.toml'} names it; "
            "a load serves only the models the configuration names, as Triton loads only what its model repository "
            "holds (add a [[models]] table to the config file, then load it or send SIGHUP)"
        )
    assert reads == []  # refused before any copy was begun
    index = (await client.post("/v2/repository/index")).json()
    assert [entry["name"] for entry in index] == ["m", "other"]
    page = (await client.get("/metrics")).text
    assert "made-up" not in page and '"extra"' not in page
    assert metric_value(page, "ffn_model_loads_total", model="(other)", outcome="failed") == len(attempts)


async def test_a_table_added_to_the_config_file_is_loaded_and_a_config_parameter_replaces_its_weights(
    start_app: StartApp, repository: Path
) -> None:
    a = write_ffn(repository / "a.safetensors", 1, d_model=D)
    b = write_ffn(repository / "b.safetensors", 2, d_model=D)
    (repository / "inside.safetensors").symlink_to(repository / "b.safetensors")
    service = await serve(start_app, repository)
    client, x = service.client, rows(2, 3)
    config = repository / "ffn.toml"
    config.write_text(config.read_text() + '\n[[models]]\nname = "extra"\nweights = "a.safetensors"\n')
    response = await load(client, "extra")  # its table, read from the file now
    assert response.status_code == 200, response.text
    assert response.json()["version"] == 1  # a model not served from the start: its first version
    y, version = await infer(client, x, "/v2/models/extra/infer")
    assert matches(y, a, x) and version == "1"
    for expected_version, weights in ((2, "b.safetensors"), (3, "inside.safetensors")):
        response = await load(client, "extra", {"weights": weights, "format": "native"})
        assert response.status_code == 200, response.text
        assert response.json()["version"] == expected_version
        y, version = await infer(client, x, "/v2/models/extra/infer")
        assert matches(y, b, x) and version == str(expected_version)
    index = (await client.post("/v2/repository/index")).json()
    assert [entry["name"] for entry in index] == ["m", "other", "extra"]


async def test_a_load_reads_no_file_outside_the_repository(start_app: StartApp, repository: Path) -> None:
    write_ffn(repository / "a.safetensors", 1, d_model=D)
    outside = repository.parent / "outside.safetensors"
    write_ffn(outside, 3, d_model=D)  # a valid weights file: only where it is makes it refused
    (repository / "escape.safetensors").symlink_to(outside)
    (repository / "sub").mkdir()
    service = await serve(start_app, repository)
    for weights in ("../outside.safetensors", str(outside), "escape.safetensors", "sub/../../outside.safetensors"):
        response = await load(service.client, "m", {"weights": weights})
        assert response.status_code == 400, weights
        assert response.json()["error_type"] == "load_failed"
        assert "outside the model repository" in response.json()["error"]
    index = (await service.client.post("/v2/repository/index")).json()
    assert [entry["name"] for entry in index] == ["m", "other"]


async def test_a_load_of_no_regular_file_fails_and_never_blocks(start_app: StartApp, repository: Path) -> None:
    a = write_ffn(repository / "a.safetensors", 1, d_model=D)
    os.mkfifo(repository / "pipe.safetensors")  # opening a FIFO to read it would wait for a writer forever
    (repository / "folder.safetensors").mkdir()
    service = await serve(start_app, repository)
    for weights, fragment in (
        ("pipe.safetensors", "not a regular file"),
        ("folder.safetensors", "not a regular file"),
        ("a\u0000b.safetensors", "null"),
    ):
        response = await load(service.client, "m", {"weights": weights})
        assert response.status_code == 400 and response.json()["error_type"] == "load_failed", response.text
        assert fragment in response.json()["error"], response.text
    y, version = await infer(service.client, rows(1, 9))
    assert matches(y, a, rows(1, 9)) and version == "1"


@pytest.mark.parametrize(
    ("body", "status", "error_type", "fragment"),
    [
        ({"parameters": {"file:1/model.safetensors": "AAAA"}}, 400, "invalid_input", "files="),
        ({"parameters": {"weights": "a.safetensors"}}, 400, "invalid_input", "unknown parameter 'weights'"),
        ({"parameters": {"config": 7}}, 400, "invalid_input", "parameter 'config' must be a string"),
        ({"parameters": {"config": ["{}"]}}, 400, "invalid_input", "'config' must be a boolean, a number or a string"),
        ({"parameters": [1]}, 400, "invalid_input", "'parameters' must be an object"),
        ({"inputs": []}, 400, "invalid_input", "unknown member 'inputs'"),
        ([1, 2], 400, "invalid_input", "must be a JSON object"),
        ({"parameters": {"config": "{not json"}}, 400, "load_failed", "not JSON"),
        ({"parameters": {"config": "[1]"}}, 400, "load_failed", "must be a JSON object"),
        ({"parameters": {"config": '{"name": "x"}'}}, 400, "load_failed", "names model 'x'"),
        ({"parameters": {"config": '{"wieghts": "a.safetensors"}'}}, 400, "load_failed", "wieghts"),
        ({"parameters": {"config": '{"weights": 5}'}}, 400, "load_failed", "must be a path"),
        ({"parameters": {"config": '{"dtype": "float64"}'}}, 400, "load_failed", "dtype"),
        ({"parameters": {"config": " " * 20000 + "{}"}}, 400, "load_failed", "at most 16384"),
    ],
)
async def test_a_malformed_load_is_a_400_and_changes_nothing(
    start_app: StartApp, repository: Path, body: Any, status: int, error_type: str, fragment: str
) -> None:
    a = write_ffn(repository / "a.safetensors", 1, d_model=D)
    service = await serve(start_app, repository)
    response = await service.client.post("/v2/repository/models/m/load", json=body)
    assert (response.status_code, response.json()["error_type"]) == (status, error_type), response.text
    assert fragment in response.json()["error"]
    y, version = await infer(service.client, rows(1, 4))
    assert matches(y, a, rows(1, 4)) and version == "1"


async def test_a_huge_or_broken_body_is_refused_before_it_is_read_whole(start_app: StartApp, repository: Path) -> None:
    write_ffn(repository / "a.safetensors", 1, d_model=D)
    service = await serve(start_app, repository)
    huge = await service.client.post("/v2/repository/models/m/load", content=b"{" * 100_000)
    assert huge.status_code == 413
    broken = await service.client.post("/v2/repository/models/m/load", content=b'{"parameters": ')
    assert broken.status_code == 400 and broken.json()["error_type"] == "invalid_input"


async def test_without_a_repository_a_config_naming_weights_is_refused(start_app: StartApp, tmp_path: Path) -> None:
    service = await start_app(load_settings(model_control="explicit", max_batch_rows=16))
    response = await load(service.client, "demo", {"weights": str(tmp_path / "x.safetensors")})
    assert response.status_code == 400 and "needs a model repository" in response.json()["error"]
    demo = await load(service.client, "demo")  # the built-in demo has no file: reloading it is allowed
    assert demo.status_code == 200 and demo.json()["version"] == 2
    # Without a config file the configuration is the models served from the start.
    other = await load(service.client, "extra", {})
    assert other.status_code == 400 and other.json()["error"].startswith(
        "no model 'extra' to load: the server was started without a config file and serves demo only; "
    )


# ----- failures keep the old copy ------------------------------------------------------------------


def _shapes(path: Path) -> None:
    w = {"layer1.weight": np.ones((64, D), np.float32), "layer2.weight": np.ones((D, 32), np.float32)}
    save_file(w, str(path))


def _not_finite(path: Path) -> None:
    w = {"layer1.weight": np.ones((64, D), np.float32), "layer2.weight": np.ones((D, 64), np.float32)}
    w["layer2.weight"][3, 5] = np.nan
    save_file(w, str(path))


def _other_d_model(path: Path) -> None:
    write_ffn(path, 5, d_model=D // 2)


def _garbage(path: Path) -> None:
    path.write_bytes(b"\x00not a safetensors file" * 10)


@pytest.mark.parametrize(
    ("writer", "fragment"),
    [
        (None, "No such file"),
        (_shapes, "shape"),
        (_not_finite, "finite"),
        (_other_d_model, f"has d_model {D // 2}, the served copy {D}"),
        (_garbage, "broken.safetensors"),
    ],
    ids=["missing", "wrong-shapes", "nan", "d_model-change", "not-weights"],
)
async def test_a_failing_load_keeps_the_old_copy_serving_and_names_the_file_and_why(
    start_app: StartApp, repository: Path, writer: Callable[[Path], None] | None, fragment: str
) -> None:
    a = write_ffn(repository / "a.safetensors", 1, d_model=D)
    service = await serve(start_app, repository)
    if writer is not None:
        writer(repository / "broken.safetensors")
    response = await load(service.client, "m", {"weights": "broken.safetensors", "activation": "relu"})
    assert response.status_code == 400 and response.json()["error_type"] == "load_failed"
    error = response.json()["error"]
    assert "broken.safetensors" in error and fragment in error, error
    if writer is not None:  # a missing file is refused before any worker hears of it
        assert error.startswith("model 'm': version 2 not loaded: ") and error.endswith("version 1 keeps serving")
    assert await metric(service.client, "ffn_model_loads_total", model="m", outcome="failed") == 1  # refused too
    assert await metric(service.client, "ffn_model_loads_total", model="m", outcome="ok") == 0
    x = rows(2, 5)
    y, version = await infer(service.client, x)
    assert matches(y, a, x) and version == "1"
    assert (await service.client.get("/v2/models/m/ready")).status_code == 200
    assert await metric(service.client, "ffn_model_state", model="m", state="READY") == 1


async def test_every_refused_load_is_counted_and_unknown_names_add_no_series(
    start_app: StartApp, repository: Path
) -> None:
    """Refusals before any file is read (missing file, bad parameters, no table, a path out of the
    repository) and failures in the worker (wrong shapes) all count as failed; names no table names
    share one label, whatever a client makes up."""
    write_ffn(repository / "a.safetensors", 1, d_model=D)
    _shapes(repository / "shapes.safetensors")
    service = await serve(start_app, repository)
    client = service.client

    async def failed(model: str) -> float:
        return await metric(client, "ffn_model_loads_total", model=model, outcome="failed")

    assert (await failed("m"), await failed("other"), await failed("(other)")) == (0, 0, 0)
    refusals = [
        ("m", {"parameters": {"config": json.dumps({"weights": "gone.safetensors"})}}),  # a missing file
        ("m", {"parameters": {"weights": "a.safetensors"}}),  # an unknown parameter
        ("other", {"parameters": {"config": json.dumps({"weights": "../x.safetensors"})}}),  # out of the repository
        ("m", {"parameters": {"config": json.dumps({"weights": "shapes.safetensors"})}}),  # fails in the worker
    ]
    for name, body in refusals:
        response = await client.post(f"/v2/repository/models/{name}/load", json=body)
        assert response.status_code == 400, response.text
    assert (await failed("m"), await failed("other")) == (3, 1)

    made_up = [f"made-up-{i}" for i in range(5)]
    for name in made_up[:2]:  # no table names them: refused before any worker hears of them
        assert (await load(client, name)).status_code == 400
    for name in made_up[
        2:4
    ]:  # a config parameter's table (its file missing or of the wrong shapes): no table names them
        weights = "gone.safetensors" if name == made_up[2] else "shapes.safetensors"
        assert (await load(client, name, {"weights": weights, "activation": "relu"})).status_code == 400
    bad = await client.post(f"/v2/repository/models/{made_up[4]}/load", json={"parameters": {"config": 7}})
    assert bad.status_code == 400
    page = (await client.get("/metrics")).text
    assert metric_value(page, "ffn_model_loads_total", model="(other)", outcome="failed") == 5
    assert not any(name in page for name in made_up)
    assert metric_value(page, "ffn_model_loads_total", outcome="failed") == 3 + 1 + 5


async def test_a_model_first_loaded_while_serving_has_its_failures_counted_from_zero(
    start_app: StartApp, repository: Path
) -> None:
    write_ffn(repository / "a.safetensors", 1, d_model=D)
    write_ffn(repository / "b.safetensors", 2, d_model=D)
    service = await serve(start_app, repository)
    config = repository / "ffn.toml"
    config.write_text(config.read_text() + '\n[[models]]\nname = "extra"\nweights = "b.safetensors"\n')
    assert (await load(service.client, "extra")).status_code == 200
    page = (await service.client.get("/metrics")).text
    assert metric_value(page, "ffn_model_loads_total", model="extra", outcome="ok") == 1
    assert 'ffn_model_loads_total{model="extra",outcome="failed"} 0.0' in page
    # Served now, so its name is its label: a failure of its next load counts under it.
    assert (await load(service.client, "extra", {"weights": "gone.safetensors"})).status_code == 400
    assert await metric(service.client, "ffn_model_loads_total", model="extra", outcome="failed") == 1


@pytest.mark.parametrize("where", ["placing the weights", "warm-up"])
async def test_out_of_memory_for_the_new_copy_fails_the_load_cleanly(
    start_app: StartApp, repository: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """On a GPU the new copy needs memory beside the old one; simulated here on the CPU."""
    a = write_ffn(repository / "a.safetensors", 1, d_model=D)
    service = await serve(start_app, repository)
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (simulated)")

    def no_room(*args: Any, **kwargs: Any) -> Any:
        raise oom

    if where == "warm-up":
        monkeypatch.setattr(ModelRunner, "warm_up", no_room)
    else:
        monkeypatch.setattr(lifecycle, "place", no_room)
    write_ffn(repository / "a.safetensors", 2, d_model=D)
    response = await load(service.client)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "out of memory on cpu: the new copy needs" in error and "beside the serving copy's" in error
    assert error.endswith("version 1 keeps serving")
    x = rows(2, 6)
    y, version = await infer(service.client, x)
    assert matches(y, a, x) and version == "1"
    monkeypatch.undo()
    again = await load(service.client)  # memory back: the same load now works, as version 3
    assert again.status_code == 200 and again.json()["version"] == 3


# ----- unload ----------------------------------------------------------------------------------------


async def test_unload_then_infer_is_a_404_and_the_model_is_listed_unavailable(
    start_app: StartApp, repository: Path
) -> None:
    a = write_ffn(repository / "a.safetensors", 1, d_model=D)
    service = await serve(start_app, repository)
    client = service.client
    served_digest = (await client.get("/v2/models/m")).json()["parameters"]["digest"]
    response = await client.post("/v2/repository/models/m/unload", json={"parameters": {"unload_dependents": False}})
    assert response.status_code == 200, response.text
    assert response.json()["version"] == 1

    gone = await client.post("/v2/models/m/infer", json={"inputs": []})
    assert gone.status_code == 404 and gone.json()["error_type"] == "model_not_found"
    assert "is unloaded" in gone.json()["error"]
    for path in ("/v2/models/m", "/v2/models/m/ready", "/v2/models/m/config", "/v2/models/m/stats"):
        assert (await client.get(path)).status_code == 404, path
    native = await client.post("/v1/models/m/transform", json={"inputs": [[0.0] * D]})
    assert native.status_code == 404
    index = {e["name"]: e for e in (await client.post("/v2/repository/index")).json()}
    assert index["m"].pop("digest") == served_digest, "the digest it last served"
    assert index["m"] == {"name": "m", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
    (listed,) = [m for m in (await client.get("/v1/models")).json()["models"] if m["name"] == "m"]
    assert (listed["state"], listed["ready"], listed["reason"], listed["d_model"]) == (
        "UNAVAILABLE",
        False,
        "unloaded",
        D,
    )
    assert await metric(client, "ffn_model_state", model="m", state="UNAVAILABLE") == 1
    assert await metric(client, "ffn_model_state", model="m", state="READY") == 0
    assert await metric(client, "ffn_model_version", model="m") == 0
    assert (await client.get("/v2/health/ready")).status_code == 200  # every loaded model is ready

    assert (await client.post("/v2/repository/models/m/unload")).status_code == 200  # unloaded already: done
    nothing = await client.post("/v2/repository/models/nosuch/unload")
    assert nothing.status_code == 404
    assert (await client.post("/v2/repository/models/other/unload")).status_code == 200
    assert (await client.get("/v2/health/ready")).status_code == 200  # nothing loaded, still ready for a load

    response = await load(client)  # read from the config file again
    assert response.status_code == 200 and response.json()["version"] == 2
    x = rows(2, 7)
    y, version = await infer(client, x)
    assert matches(y, a, x) and version == "2"


async def test_a_model_no_table_names_leaves_the_index_and_metrics_once_unloaded_and_comes_back_afresh(
    start_app: StartApp, repository: Path
) -> None:
    """Issue 28 class 7: unloaded names stayed in the index and their series in /metrics forever.
    A model still named by a table stays listed once unloaded (to be loaded again, as Triton lists
    its repository's models); one whose table is gone is forgotten when unloaded."""
    a = write_ffn(repository / "a.safetensors", 1, d_model=D)
    service = await serve(start_app, repository)
    client, config = service.client, repository / "ffn.toml"
    x = np.random.default_rng(11).standard_normal((2, 512)).astype(np.float32)
    await demo_infer(client, x, "other")
    page = (await client.get("/metrics")).text
    assert metric_value(page, "ffn_requests_total", model="other", outcome="ok", protocol="http") == 1
    assert 'nv_inference_request_success{model="other",version="1"}' in page  # Triton's names too

    config.write_text('max_batch_rows = 16\n\n[[models]]\nname = "m"\nweights = "a.safetensors"\n')
    refused = await load(client, "other")  # still served, but no table names it: no reload either
    assert refused.status_code == 400 and "no [[models]] table of the config file" in refused.json()["error"]
    await demo_infer(client, x, "other")  # served until unloaded
    assert (await client.post("/v2/repository/models/other/unload")).status_code == 200
    index = (await client.post("/v2/repository/index")).json()
    assert [entry["name"] for entry in index] == ["m"]
    assert [entry["name"] for entry in (await client.get("/v1/models")).json()["models"]] == ["m"]
    gone = await client.get("/v2/models/other")
    assert gone.status_code == 404 and "is not served here" in gone.json()["error"]
    page = (await client.get("/metrics")).text
    assert 'model="other"' not in page, [line for line in page.splitlines() if 'model="other"' in line]
    assert metric_value(page, "ffn_requests_total", model="m", outcome="ok", protocol="http") == 0  # m's stay
    assert (await client.post("/v2/repository/models/other/unload")).status_code == 404  # nothing left of it

    # m unloaded while its table names it: listed UNAVAILABLE; its table removed, SIGHUP forgets it.
    assert (await client.post("/v2/repository/models/m/unload")).status_code == 200
    assert [e["name"] for e in (await client.post("/v2/repository/index")).json()] == ["m"]
    config.write_text('max_batch_rows = 16\n\n[[models]]\nname = "other"\n')
    await service.app.state.service.engine.apply_config_file()  # other added, m's table gone
    index = {e["name"]: e["state"] for e in (await client.post("/v2/repository/index")).json()}
    assert index == {"other": "READY"}
    page = (await client.get("/metrics")).text
    assert 'model="m"' not in page
    # other named again: its series start afresh, and count its requests (the doors' too).
    assert metric_value(page, "ffn_requests_total", model="other", outcome="ok", protocol="http") == 0
    assert metric_value(page, "ffn_model_loads_total", model="other", outcome="ok") == 1
    await demo_infer(client, x, "other")
    page = (await client.get("/metrics")).text
    assert metric_value(page, "ffn_requests_total", model="other", outcome="ok", protocol="http") == 1
    assert metric_value(page, "ffn_model_state", model="other", state="READY") == 1
    config.write_text(config.read_text() + '\n[[models]]\nname = "m"\nweights = "a.safetensors"\n')
    assert (await load(client, "m")).status_code == 200  # named again: loaded again
    y, _ = await infer(client, rows(2, 12))
    assert matches(y, a, rows(2, 12))


async def demo_infer(client: httpx.AsyncClient, x: np.ndarray, name: str) -> None:
    """A V2 infer of the demo weights (served as `name`), checked against the float64 reference."""
    y, _ = await infer(client, x, f"/v2/models/{name}/infer")
    assert_close(y, demo_reference(x))


# ----- order, drain ----------------------------------------------------------------------------------


async def test_loads_of_one_model_apply_in_order_and_other_models_do_not_wait(
    start_app: StartApp, repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_ffn(repository / "a.safetensors", 1, d_model=D)
    service = await serve(start_app, repository)
    entered, release = threading.Event(), threading.Event()
    reads: list[str] = []
    read = lifecycle.read_weights

    def held_first(spec: Any, path: Any = None) -> Any:
        reads.append(spec.name)
        if reads.count("m") == 1 and spec.name == "m":
            entered.set()
            assert release.wait(60), "the test never let the read go"
        return read(spec, path)

    monkeypatch.setattr(lifecycle, "read_weights", held_first)
    try:
        first = asyncio.create_task(load(service.client))
        assert await asyncio.to_thread(entered.wait, 60)
        second = asyncio.create_task(load(service.client))
        other = await load(service.client, "other")  # another model's load does not wait for m's
        assert other.status_code == 200 and other.json()["version"] == 2
        assert reads.count("m") == 1, "the second load of m began before the first had finished"
        release.set()
        answers = await asyncio.gather(first, second)
    finally:
        release.set()
    assert [answer.json()["version"] for answer in answers] == [2, 3]
    assert service.app.state.service.engine.model("m").version == 3


async def test_a_load_when_draining_is_refused_and_a_drain_during_a_load_serves_nothing_new(
    start_app: StartApp, repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_ffn(repository / "a.safetensors", 1, d_model=D)
    service = await serve(start_app, repository)
    engine = service.app.state.service.engine
    entered, release = threading.Event(), threading.Event()
    read = lifecycle.read_weights

    def held(spec: Any, path: Any = None) -> Any:
        entered.set()
        assert release.wait(60)
        return read(spec, path)

    monkeypatch.setattr(lifecycle, "read_weights", held)
    loading = asyncio.create_task(load(service.client))
    assert await asyncio.to_thread(entered.wait, 60)
    assert await engine.drain()
    release.set()
    response = await loading
    assert response.status_code == 400 or response.status_code == 503, response.text
    assert "shutting down" in response.json()["error"]
    assert engine.model("m").version == 1
    refused = await load(service.client)
    assert refused.status_code == 503 and "draining" in refused.json()["error"]


# ----- the config file read again (SIGHUP's work; the signal itself: test_model_control_workers.py) ----


async def test_the_config_file_read_again_loads_the_changes_and_unloads_what_it_no_longer_names(
    start_app: StartApp, repository: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_ffn(repository / "a.safetensors", 1, d_model=D)
    service = await serve(start_app, repository)
    engine, client = service.app.state.service.engine, service.client
    b = write_ffn(repository / "a.safetensors", 2, d_model=D)  # m: its file replaced
    c = write_ffn(repository / "c.safetensors", 3, d_model=D)
    (repository / "ffn.toml").write_text(  # other: removed; n: added
        'max_batch_rows = 16\n\n[[models]]\nname = "m"\nweights = "a.safetensors"\n\n'
        '[[models]]\nname = "n"\nweights = "c.safetensors"\n'
    )
    with caplog.at_level(logging.INFO, logger="ffn_serve"):
        await engine.apply_config_file()
    assert "m changed (" in caplog.text and "a.safetensors was replaced)" in caplog.text
    assert "n added" in caplog.text and "other removed" in caplog.text
    x = rows(2, 8)
    y, version = await infer(client, x)
    assert matches(y, b, x) and version == "2"
    y, version = await infer(client, x, "/v2/models/n/infer")
    assert matches(y, c, x) and version == "1"
    index = {e["name"]: (e["version"], e["state"]) for e in (await client.post("/v2/repository/index")).json()}
    assert index == {"m": ("2", "READY"), "n": ("1", "READY")}  # other: no table names it, unloaded, forgotten
    assert 'model="other"' not in (await client.get("/metrics")).text

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ffn_serve"):
        await engine.apply_config_file()  # nothing changed since
    assert "nothing changed" in caplog.text
    (repository / "ffn.toml").write_text('[[models]]\nname = "m"\nwieghts = "a.safetensors"\n')
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ffn_serve"):
        await engine.apply_config_file()
    assert "not applied" in caplog.text and "wieghts" in caplog.text
    assert engine.model("m").version == 2 and engine.model("n").version == 1


# ----- the settings ----------------------------------------------------------------------------------


def test_the_settings_name_a_wrong_mode_and_a_repository_that_is_no_folder(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as wrong:
        load_settings(model_control="explict")
    (problem,) = wrong.value.problems
    assert "model_control" in problem and "explicit" in problem
    with pytest.raises(SettingsError) as missing:
        load_settings(model_repository=tmp_path / "nowhere")
    (problem,) = missing.value.problems
    assert "model_repository" in problem and "is not a folder" in problem
    (tmp_path / "ffn.toml").write_text("")
    assert load_settings(config=tmp_path / "ffn.toml").repository() == tmp_path.resolve()
    assert load_settings(model_repository=tmp_path, config=tmp_path / "ffn.toml").repository() == tmp_path.resolve()
    assert load_settings().repository() is None
