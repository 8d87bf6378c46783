"""Model control with real servers: a reload under load with 2 workers, SIGHUP, a replacement worker.

Each request goes on a connection of its own, so both workers answer; every answer is checked
against the float64 numpy FFN of the weights of the version that answered (V2's model_version).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from tritonclient.grpc import InferenceServerClient, InferInput
from tritonclient.grpc import service_pb2 as pb

from ffn_testing import ServerProcess, http_request, metric_value, raw_request, start_server
from tests.grpc_helpers import stub, trailers
from tests.model_files import matches, write_ffn
from tests.test_workers import replaced, scrape, worker_pids

pytestmark = pytest.mark.server  # every test here starts a real ffn-serve

D = 16
KEY = "model-control-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LOG_WAIT_S = 180.0  # a worker's start on a busy machine takes seconds; this is only the give-up


def config(folder: Path, models: str) -> Path:
    path = folder / "ffn.toml"
    path.write_text(f"max_batch_rows = 64\nmodel_control = 'explicit'\n\n{models}")
    return path


M = '[[models]]\nname = "m"\nweights = "a.safetensors"\n'
N = '[[models]]\nname = "n"\nweights = "c.safetensors"\n'
FORGOTTEN = "model {}: no [[models]] table names it: it leaves the repository index and /metrics"


async def infer(port: int, name: str, x: np.ndarray, headers: dict[str, str] | None = None) -> tuple[int, object]:
    """A V2 JSON infer on a new connection: (status, output and model_version, or the error body)."""
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    request = http_request(
        "POST",
        f"/v2/models/{name}/infer",
        {"content-type": "application/json", **(headers or {})},
        json.dumps(body).encode(),
    )
    response = await raw_request(port, request)
    answer = response.json()
    if response.status != 200:
        return response.status, answer
    assert isinstance(answer, dict)
    y = np.asarray(answer["outputs"][0]["data"], dtype=np.float64).reshape(x.shape)
    return 200, (y, answer["model_version"])


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)


async def until(check: Callable[[], bool], server: ServerProcess, what: str) -> None:
    """Wait for `check()` (the server's log or state), giving up after LOG_WAIT_S with the log."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + LOG_WAIT_S
    while not check():
        assert loop.time() < give_up, f"{what} did not happen; log:\n{server.logs()}"
        await asyncio.sleep(0.1)


async def test_a_reload_under_load_with_two_workers_fails_no_request_and_a_replacement_serves_it(
    tmp_path: Path,
) -> None:
    a = write_ffn(tmp_path / "a.safetensors", 1, d_model=D)
    env = {"FFN_WORKERS": "2", "FFN_API_KEY": KEY}
    with start_server(config=config(tmp_path, M), env=env) as server:
        keyless = httpx.post(f"{server.url}/v2/repository/models/m/load", timeout=30)
        assert keyless.status_code == 401  # loading needs the API key, as every route but health

        answers: list[tuple[int, np.ndarray, object, bool]] = []  # status, input, (output, version), sent after
        loaded = asyncio.Event()  # the load has answered

        async def send(seed: int) -> None:
            for i in range(100_000):
                after = loaded.is_set()
                if after and sum(sent_after for *_, sent_after in answers) >= 64:
                    return
                x = rows(int(np.random.default_rng(seed * 1000 + i).integers(1, 17)), seed * 1000 + i)
                status, result = await infer(server.port, "m", x, AUTH)
                answers.append((status, x, result, after))

        senders = [asyncio.create_task(send(seed)) for seed in range(16)]
        while len(answers) < 64:  # under way before the reload
            await asyncio.sleep(0.01)
        b = write_ffn(tmp_path / "a.safetensors", 2, d_model=D)
        response = await asyncio.to_thread(
            httpx.post, f"{server.url}/v2/repository/models/m/load", headers=AUTH, timeout=120
        )
        loaded.set()
        await asyncio.gather(*senders)

        assert response.status_code == 200, response.text
        assert [(w["worker"], w["version"]) for w in response.json()["workers"]] == [(1, 2), (2, 2)]
        failed = [(status, result) for status, _, result, _ in answers if status != 200]
        assert failed == [], f"{len(failed)} of {len(answers)} requests failed: {failed[:3]}"
        weights = {"1": a, "2": b}
        for _, x, result, _ in answers:
            y, version = result  # type: ignore[misc]
            assert matches(y, weights[version], x), f"an answer of version {version} is not that version's"
        after_load = {result[1] for _, _, result, sent_after in answers if sent_after}  # type: ignore[index]
        assert after_load == {"2"}, "once the load has answered, every worker serves version 2"
        assert {result[1] for _, _, result, _ in answers} == {"1", "2"}  # type: ignore[index]

        # A worker started later replays the load before it takes traffic: it serves version 2 too.
        victim = min(worker_pids(scrape(server.url, AUTH)))
        os.kill(victim, signal.SIGKILL)
        await until(lambda: replaced(server.logs(), victim), server, f"the replacement of worker pid {victim}")
        after_kill = server.logs().partition(f"(pid {victim}) was killed by SIGKILL")[2]
        started = re.search(r"worker (\d) started \(pid (\d+)\)", after_kill)
        assert started, after_kill
        replacement_log = after_kill[started.end() : after_kill.index(f"(pid {started[2]}) ready")]
        assert re.search(rf"\[worker {started[1]}\].*model m version 2 serving", replacement_log), replacement_log
        for seed in range(40):
            x = rows(4, 10_000 + seed)
            status, result = await infer(server.port, "m", x, AUTH)
            assert status == 200, result
            y, version = result  # type: ignore[misc]
            assert version == "2" and matches(y, b, x)


async def test_sighup_to_the_supervisor_applies_the_changed_config_file_in_every_worker(tmp_path: Path) -> None:
    write_ffn(tmp_path / "a.safetensors", 1, d_model=D)
    path = config(tmp_path, M)
    with start_server(config=path, env={"FFN_WORKERS": "2"}) as server:
        b = write_ffn(tmp_path / "a.safetensors", 2, d_model=D)
        c = write_ffn(tmp_path / "c.safetensors", 3, d_model=D)
        config(tmp_path, M + "\n" + N)
        os.kill(server.pid, signal.SIGHUP)

        def applied() -> bool:
            logs = server.logs()
            return logs.count("model m version 2 serving") == 2 and logs.count("model n version 1 serving") == 2

        await until(applied, server, "the config file applied in both workers")
        logs = server.logs()
        assert "received SIGHUP: worker" in logs
        assert re.search(r"SIGHUP: config file .*: n added, m changed \(.*a\.safetensors was replaced\)", logs), logs
        for seed in range(20):
            x = rows(3, seed)
            for name, weights, expected in (("m", b, "2"), ("n", c, "1")):
                status, result = await infer(server.port, name, x)
                assert status == 200, result
                y, version = result  # type: ignore[misc]
                assert version == expected and matches(y, weights, x)
        assert server.proc.poll() is None  # SIGHUP is no stop


async def test_sighup_to_one_process_applies_the_config_file_and_with_control_off_changes_nothing(
    tmp_path: Path,
) -> None:
    a = write_ffn(tmp_path / "a.safetensors", 1, d_model=D)
    path = config(tmp_path, M + "\n" + N.replace("c.safetensors", "a.safetensors"))
    with start_server(config=path) as server:
        config(tmp_path, M)  # n removed
        os.kill(server.pid, signal.SIGHUP)
        await until(lambda: FORGOTTEN.format("n") in server.logs(), server, "n unloaded and forgotten")
        index = httpx.post(f"{server.url}/v2/repository/index", timeout=30).json()
        assert {e["name"]: e["state"] for e in index} == {"m": "READY"}  # no table names n: not listed
        status, result = await infer(server.port, "m", rows(2, 1))
        assert status == 200 and matches(result[0], a, rows(2, 1))  # type: ignore[index]

    with start_server(config=path, env={"FFN_MODEL_CONTROL": "none"}) as server:
        write_ffn(tmp_path / "a.safetensors", 2, d_model=D)
        os.kill(server.pid, signal.SIGHUP)
        await until(lambda: "SIGHUP ignored: model_control is none" in server.logs(), server, "SIGHUP logged")
        status, result = await infer(server.port, "m", rows(2, 2))
        assert status == 200 and matches(result[0], a, rows(2, 2))  # type: ignore[index]
        assert result[1] == "1"  # type: ignore[index]


def test_a_grpc_load_reaches_both_workers_and_answers_once_both_serve_the_new_weights(tmp_path: Path) -> None:
    """tritonclient.grpc's load_model with 2 workers: the same broadcast as the HTTP route's, so
    when it returns every worker serves version 2 (the gauge is the lowest any worker serves)."""
    write_ffn(tmp_path / "a.safetensors", 1, d_model=D)
    env = {"FFN_WORKERS": "2", "FFN_API_KEY": KEY}
    with start_server(config=config(tmp_path, M), env=env) as server:
        b = write_ffn(tmp_path / "a.safetensors", 2, d_model=D)  # the operator's workflow: replace, then load
        headers = {"authorization": f"Bearer {KEY}"}
        client = InferenceServerClient(server.grpc_target)
        try:
            client.load_model("m", headers=headers)
        finally:
            client.close()
        page = scrape(server.url, AUTH)
        assert metric_value(page, "ffn_model_version", model="m") == 2  # livemin: both workers
        assert metric_value(page, "ffn_model_loads_total", model="m", outcome="ok") == 2  # one per worker
        for seed in range(8):  # a channel each: the kernel spreads them over the workers
            x = rows(3, seed)
            client = InferenceServerClient(server.grpc_target)
            try:
                tensor = InferInput("input", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                result = client.infer("m", [tensor], headers=headers)
            finally:
                client.close()
            assert result.get_response().model_version == "2"
            assert matches(result.as_numpy("output"), b, x)


async def test_names_no_table_names_are_refused_on_both_doors_and_a_model_whose_table_is_gone_leaves_every_worker(
    tmp_path: Path,
) -> None:
    """Issue 28 class 7 through a real server with --model-control explicit and 2 workers: a load of
    a name no [[models]] table names (with `config {}`, which built a copy of the demo weights before)
    is refused alike over HTTP and gRPC, and adds no series and no index entry; a model whose table
    is removed, once unloaded, leaves the index and /metrics of both workers (whose files
    prometheus_client keeps: the scrape leaves it out), while m serves on, checked against numpy."""
    a = write_ffn(tmp_path / "a.safetensors", 1, d_model=D)
    path = tmp_path / "ffn.toml"
    path.write_text(f"max_batch_rows = 64\n\n{M}\n{N.replace('c.safetensors', 'a.safetensors')}")
    env = {"FFN_WORKERS": "2", "FFN_ACCESS_LOG": "true"}  # the access log says which worker answered
    with start_server(config=path, env=env, args=["--model-control", "explicit"]) as server:
        parameters = {"config": pb.ModelRepositoryParameter(string_param="{}")}
        async with stub(server.grpc_target) as client:
            for i in range(10):
                name = f"made-up-{i}"
                answer = httpx.post(
                    f"{server.url}/v2/repository/models/{name}/load", json={"parameters": {"config": "{}"}}, timeout=60
                )
                assert answer.status_code == 400 and answer.json()["error_type"] == "load_failed", answer.text
                assert answer.json()["error"].startswith(f"no model {name!r} to load: no [[models]] table of ")
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await client.RepositoryModelLoad(
                        pb.RepositoryModelLoadRequest(model_name=name, parameters=parameters), timeout=60
                    )
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert refused.value.details() == answer.json()["error"]
                assert trailers(refused.value)["ffn-error-type"] == "load_failed"
        for _ in range(6):  # a connection each: both workers answer
            index = httpx.post(f"{server.url}/v2/repository/index", timeout=30).json()
            assert [e["name"] for e in index] == ["m", "n"]
            page = scrape(server.url)
            assert "made-up" not in page
        assert metric_value(page, "ffn_model_loads_total", model="(other)", outcome="failed") == 20

        status, _ = await infer(server.port, "n", rows(2, 1))  # n's series hold a request in some worker
        assert status == 200
        assert 'model="n"' in scrape(server.url)
        path.write_text(f"max_batch_rows = 64\n\n{M}")  # n's table removed, then n unloaded
        unloaded = httpx.post(f"{server.url}/v2/repository/models/n/unload", timeout=120)
        assert unloaded.status_code == 200, unloaded.text
        assert server.logs().count(FORGOTTEN.format("n")) == 2  # in both workers, before the answer
        metrics_line = re.compile(r"\[worker (\d)\] uvicorn\.access: .*\"GET /metrics HTTP/1\.1\" 200")
        answered: set[str] = set()
        for round_ in range(40):  # until both workers have answered a scrape since
            before = len(metrics_line.findall(server.logs()))
            page = scrape(server.url)
            assert 'model="n"' not in page, [line for line in page.splitlines() if 'model="n"' in line]
            assert metric_value(page, "ffn_model_state", model="m", state="READY") == 2  # m's stay
            index = httpx.post(f"{server.url}/v2/repository/index", timeout=30).json()
            assert [e["name"] for e in index] == ["m"]
            answered |= set(metrics_line.findall(server.logs())[before:])
            x = rows(3, round_)
            status, result = await infer(server.port, "m", x)
            assert status == 200 and matches(result[0], a, x)  # type: ignore[index]
            if answered == {"1", "2"} and round_ >= 5:
                break
        assert answered == {"1", "2"}, server.logs()
        gone = httpx.get(f"{server.url}/v2/models/n", timeout=30)
        assert gone.status_code == 404 and "is not served here" in gone.json()["error"]
