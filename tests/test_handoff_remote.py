"""The engine facade a front process serves its doors (app/handoff/remote.py): the engine's models,
readiness and lookups as the in-process engine shows them, model control that reaches the engine
once and every front's table after it, and a front that is not ready while no engine is linked and
serves again once one is."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from app.config.settings import load_settings
from app.engine.errors import LoadFailed, ModelNotFound, Unavailable
from app.engine.registry import Registry
from app.engine.service import Engine
from app.handoff import engine as engine_side
from app.handoff.engine import EngineServer
from app.handoff.front import Ask, EngineClient
from app.handoff.remote import RemoteEngine
from app.observe.collectors import GpuReading
from app.observe.identity import CURRENT, RequestContext
from app.observe.metrics import MULTIPROCESS_VARIABLE, Metrics
from app.observe.triton_metrics import TritonNames
from app.process.engine_process import launch
from app.protocol.v2.statistics import model_stats
from ffn_core.dtypes import DTYPES
from tests.reference import assert_close, demo_reference

F32 = DTYPES["float32"]


@dataclass
class Served:
    engine: Engine
    metrics: Metrics
    server: EngineServer
    socket: Path


@pytest.fixture
async def served(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> AsyncIterator[Served]:
    """An engine serving the demo as `demo` and `other`, model control explicit, on a Unix socket."""
    monkeypatch.setenv("FFN_WARMUP", "0")
    config = tmp_path / "ffn.toml"
    config.write_text('[[models]]\nname = "demo"\n\n[[models]]\nname = "other"\n')
    metrics = Metrics()
    settings = load_settings(config=config, model_control="explicit")
    engine = Engine(settings, Registry(settings, metrics))
    await engine.start()
    await engine.until_warm()
    server = EngineServer(engine, tmp_path / "engine.sock")
    await server.start()
    yield Served(engine, metrics, server, tmp_path / "engine.sock")
    await server.close()
    await engine.stop()


@pytest.fixture
async def front(served: Served) -> AsyncIterator[RemoteEngine]:
    remote = RemoteEngine([EngineClient(served.socket)], served.engine.settings)
    await remote.start()
    await asyncio.wait_for(remote.until_warm(), 10)
    yield remote
    await remote.close()


async def eventually(check: Callable[[], bool], seconds: float = 5.0) -> None:
    """Wait until `check()` holds: a table reaches every front within the engine's TABLE_EVERY_S."""
    async with asyncio.timeout(seconds):
        while not check():
            await asyncio.sleep(0.02)


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 512)).astype(np.float32)


async def test_the_front_sees_the_engines_models_as_the_engine_does(served: Served, front: RemoteEngine) -> None:
    engine = served.engine
    assert [m.describe() for m in front.listed()] == [m.describe() for m in engine.listed()]
    assert front.readiness() == engine.readiness() and front.ready
    assert front.cuda_available == engine.cuda_available
    local, remote = engine.model("demo"), front.model("demo")
    assert (remote.name, remote.version, remote.digest, remote.d_model) == ("demo", local.version, local.digest, 512)
    assert remote.dtype == local.dtype and remote.dropout == local.dropout
    assert remote.weight_bytes == local.weight_bytes > 0
    assert str(remote.device) == str(local.device) == "cpu" and remote.device.type == "cpu"
    shape = local.config
    assert remote.config.d_ff == shape.d_ff and remote.config.activation == shape.activation
    assert remote.config.gated == shape.gated and remote.config.variant == shape.variant
    remote.check_serving()
    x = rows(3)
    assert_close(await remote.infer(x, F32, deadline=None), demo_reference(x.astype(np.float64)))
    for name, version in (("nope", None), ("demo", "7")):  # the same refusals, word for word
        with pytest.raises(ModelNotFound) as here:
            engine.model(name, version)
        with pytest.raises(ModelNotFound) as there:
            front.model(name, version)
        assert there.value.message == here.value.message and there.value.version == here.value.version


async def test_model_control_reaches_the_engine_once_and_every_front_sees_it(
    served: Served, front: RemoteEngine
) -> None:
    other_front = RemoteEngine([EngineClient(served.socket)], served.engine.settings)
    await other_front.start()
    await asyncio.wait_for(other_front.until_warm(), 10)
    try:
        version = served.engine.model("other").version
        result = await front.unload("other")
        assert result["name"] == "other"
        assert "other" not in [m.name for m in served.engine.models()]  # in the engine, once
        with pytest.raises(ModelNotFound) as gone:  # the asking front knows before its answer
            front.model("other")
        assert gone.value.unloaded
        listed = {m.name: m.describe() for m in front.listed()}
        assert listed["other"]["state"] == "UNAVAILABLE" and listed["other"]["reason"] == "unloaded"
        await eventually(lambda: "other" not in [m.name for m in other_front.models()])

        result = await front.load("other")
        assert served.engine.model("other").version == version + 1 == result["version"]
        assert front.model("other").version == version + 1
        await eventually(lambda: "other" in [m.name for m in other_front.models()])
        assert other_front.model("other").digest == served.engine.model("other").digest

        with pytest.raises(LoadFailed) as refused:  # the engine's refusal, as it raised it
            await front.load("never-configured")
        assert "never-configured" in refused.value.message
        loads = served.metrics.registry.get_sample_value
        before = loads("ffn_model_loads_total", {"model": "(other)", "outcome": "failed"}) or 0.0
        front.count_refused_load("made-up")  # a door's refusal, counted where the model series live
        await eventually(
            lambda: loads("ffn_model_loads_total", {"model": "(other)", "outcome": "failed"}) == before + 1
        )
    finally:
        await other_front.close()


async def test_without_an_engine_the_front_is_unready_and_serves_again_once_one_listens(
    served: Served, front: RemoteEngine
) -> None:
    await served.server.close()  # the engine's process "dies": its socket ends
    await eventually(lambda: not front.ready)
    assert "engine process is not running" in front.readiness().reason
    with pytest.raises(Unavailable):
        front.model("demo").check_serving()
    with pytest.raises(Unavailable):
        await front.model("demo").infer(rows(1), F32, deadline=None)

    served.socket.unlink(missing_ok=True)
    restarted = EngineServer(served.engine, served.socket)
    await restarted.start()
    try:
        await eventually(lambda: front.ready)
        x = rows(2, 5)
        assert_close(await front.model("demo").infer(x, F32, deadline=None), demo_reference(x.astype(np.float64)))
    finally:
        await restarted.close()


@pytest.mark.server
async def test_an_engine_process_rereads_its_config_on_sighup_and_its_statistics_reach_the_front(
    tmp_path: Path,
) -> None:
    config, folder = tmp_path / "ffn.toml", tmp_path / "metrics"
    folder.mkdir()
    config.write_text('[[models]]\nname = "demo"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")} | {
        "FFN_WARMUP": "0",
        "FFN_CONFIG": str(config),
        "FFN_MODEL_CONTROL": "explicit",  # SIGHUP applies the file only then, as in the service
        MULTIPROCESS_VARIABLE: str(folder),  # as the supervisor gives every process it starts
    }
    engine = await asyncio.to_thread(launch, tmp_path / "engine.sock", env)
    front = RemoteEngine([EngineClient(tmp_path / "engine.sock")], load_settings())
    try:
        await front.start()
        await asyncio.wait_for(front.until_warm(), 30)
        assert [m.name for m in front.models()] == ["demo"]
        sizes = [1, 2, 3, 4, 5, 6, 7]
        for n in sizes:
            x = rows(n, n)
            assert_close(await front.model("demo").infer(x, F32, deadline=None), demo_reference(x.astype(np.float64)))
        # The front's statistics, read from the folder the engine writes its model series in.
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(folder))
        (stats,) = model_stats(registry, front.models())["model_stats"]
        assert stats["name"] == "demo" and stats["inference_count"] == sum(sizes)
        assert stats["inference_stats"]["success"]["count"] == len(sizes)

        config.write_text('[[models]]\nname = "demo"\n\n[[models]]\nname = "second"\n')
        engine.send_signal(signal.SIGHUP)
        await eventually(lambda: "second" in [m.name for m in front.models()], seconds=30)
        await eventually(lambda: front.model("second").status.ready, seconds=30)
        x = rows(2, 11)
        assert_close(await front.model("second").infer(x, F32, deadline=None), demo_reference(x.astype(np.float64)))
    finally:
        await front.close()
        engine.terminate()
        assert await asyncio.to_thread(engine.wait, 30) == 0  # SIGTERM drains and exits 0


async def test_no_memory_for_a_new_link_is_said_by_readiness_and_each_request_not_a_crash(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A link's memory is reserved when it is made (a page first touched under load past what is left
    # would be a SIGBUS), so a host without it is a front that says why it cannot link.
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(os, "posix_fallocate", full)
    front = RemoteEngine([EngineClient(served.socket)], served.engine.settings)
    await front.start()
    try:
        await eventually(lambda: "no room for the hand-off's slots" in front.readiness().reason)
        reason = front.readiness().reason
        assert not front.ready and "64 MiB of shared memory" in reason and "FFN_HANDOFF_SLOTS" in reason
        assert "--memory" in reason
        client = EngineClient(served.socket)  # a request through the hand-off: 503 naming why
        with pytest.raises(Unavailable, match="no room for the hand-off's slots"):
            await client.infer(Ask("demo", None, rows(1), F32, deadline=None))
        await client.close()
        monkeypatch.undo()  # room again: the front links at its next try
        await asyncio.wait_for(front.until_warm(), 10)
        x = rows(2, 3)
        assert_close(await front.model("demo").infer(x, F32, deadline=None), demo_reference(x.astype(np.float64)))
    finally:
        await front.close()


async def test_a_front_scrapes_the_gpus_its_engine_computes_on(
    served: Served, front: RemoteEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine reads its GPUs (here an injected reading: this machine has none) and sends them when
    they change; a front's ffn_gpu_memory_* and nv_gpu_* show them, and a front that links later gets
    them at once."""
    reading = GpuReading("GPU-5f1f6c1e-90b8-2d4c-8d3a-0c2e3d4b5a61", 0.25, 3 * 2**30, 80 * 2**30, 250.5, "cuda:1")
    assert front.gpus() == []
    monkeypatch.setattr(engine_side, "GPUS_EVERY_S", 0.05)
    monkeypatch.setattr(served.engine, "gpus", lambda: [reading])
    await eventually(lambda: front.gpus() == [reading])
    metrics = Metrics()
    metrics.gpus = front.gpus
    assert metrics.merged.get_sample_value("ffn_gpu_memory_used_bytes", {"device": "cuda:1"}) == 3 * 2**30
    assert metrics.merged.get_sample_value("ffn_gpu_memory_total_bytes", {"device": "cuda:1"}) == 80 * 2**30
    text = TritonNames(versions=lambda: {}, gpus=front.gpus).gpu_text()
    assert f'nv_gpu_power_usage{{gpu_uuid="{reading.uuid}"}} 250.5' in text
    assert f'nv_gpu_utilization{{gpu_uuid="{reading.uuid}"}} 0.25' in text

    monkeypatch.setattr(engine_side, "GPUS_EVERY_S", 3600.0)  # no more reads: only the greeting can tell it
    later = RemoteEngine([EngineClient(served.socket)], served.engine.settings)
    await later.start()
    try:
        await asyncio.wait_for(later.until_warm(), 10)
        await eventually(lambda: later.gpus() == [reading])
    finally:
        await later.close()


async def test_an_answer_names_the_copy_that_computed_it_when_a_reload_raced_the_request(
    served: Served, front: RemoteEngine
) -> None:
    """A door looks its model up in the front's table, then the request crosses to the engine: a reload
    in between means another copy computes it. Within that request the model names the copy that did
    (its version and digest, which the answer carries); outside it, the table's."""
    looked_up = front.model("demo")  # as a door holds it, from the table of version 1
    assert looked_up.version == 1
    await served.engine.load("demo")  # the engine serves version 2 before the request reaches it
    computing = served.engine.model("demo")
    assert computing.version == 2
    context = RequestContext("raced-1")
    token = CURRENT.set(context)
    try:
        x = rows(2)
        assert_close(await looked_up.infer(x, F32, deadline=None), demo_reference(x.astype(np.float64)))
        assert (looked_up.version, looked_up.digest) == (2, computing.digest)
        assert front.model("other").version == 1  # another model of the same request's front: its table's
    finally:
        CURRENT.reset(token)
    assert looked_up.version == 1  # no request: the table the front looked it up in
