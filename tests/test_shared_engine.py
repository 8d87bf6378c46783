"""Workers as fronts of one engine process (`shared_engine`, issue 30): real servers on 127.0.0.1.

Answers equal to numpy through both doors with 2 and 3 fronts, statistics exact across them, and one
process alone mapping libtorch; a killed engine fails what is in flight with 503 and the service
serves again once it is restarted; a killed front is replaced; a drain under load answers
everything accepted; a model load reaches the engine once and every front sees it.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from ffn_testing import ServerProcess, free_port, metric_value, start_server
from tests.grpc_helpers import infer_request, output_of, stub
from tests.reference import demo_reference
from tests.slow_model import slow_model_config
from tests.wire import raw_headers

D_MODEL = 512
SHARED = {"FFN_SHARED_ENGINE": "true", "FFN_WARMUP": "false"}

pytestmark = pytest.mark.server


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, D_MODEL)).astype(np.float32)


def wait_for_log(server: ServerProcess, pattern: str, seconds: float = 120.0, after: int = 0) -> re.Match[str]:
    """The first match of `pattern` in the server's log past character `after`."""
    give_up = time.monotonic() + seconds
    while True:
        found = re.search(pattern, server.logs()[after:])
        if found is not None:
            return found
        assert server.proc.poll() is None and time.monotonic() < give_up, f"no {pattern!r} in:\n{server.logs()}"
        time.sleep(0.05)


def engine_pid(server: ServerProcess) -> int:
    (pid,) = re.findall(r"engine process started \(pid (\d+)\)", server.logs())[-1:]
    return int(pid)


def maps_libtorch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


async def test_three_fronts_answer_through_both_doors_and_one_process_maps_torch() -> None:
    with start_server(env={"FFN_WORKERS": "3", **SHARED}) as server:
        await answers_through_both_doors(server, 3)


async def answers_through_both_doors(server: ServerProcess, fronts: int) -> None:
    """Equal to numpy through the native, V2 JSON and gRPC endpoints on connections spread over the
    fronts; each request counted once; libtorch in the engine alone. The first demo requests sent."""
    wait_for_log(server, rf"ready: {fronts} fronts and one engine process")
    processes = server.worker_pids()
    assert len(processes) == fronts + 1  # the engine and the fronts
    assert [pid for pid in processes if maps_libtorch(pid)] == [engine_pid(server)]
    assert not maps_libtorch(server.pid)  # nor the supervisor
    if hasattr(os, "SCHED_BATCH"):  # woken by a front, the engine never preempts it; the fronts as any process
        assert [os.sched_getscheduler(pid) == os.SCHED_BATCH for pid in (server.pid, *processes)] == [
            pid == engine_pid(server) for pid in (server.pid, *processes)
        ]

    sent = 0
    for i in range(12):  # a connection each: the kernel spreads them over the fronts
        x = rows(1 + i % 4, i)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            r = await client.post("/v1/models/demo/transform", content=x.tobytes(), headers=raw_headers(x.shape))
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(
                np.frombuffer(r.content, "<f4").reshape(x.shape), demo_reference(x), rtol=1e-5, atol=1e-5
            )
            body = {
                "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]
            }
            r = await client.post("/v2/models/demo/infer", json=body)
            assert r.status_code == 200, r.text
            y = np.asarray(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(x.shape)
            np.testing.assert_allclose(y, demo_reference(x), rtol=1e-5, atol=1e-5)
        async with stub(server.grpc_target, **{"grpc.use_local_subchannel_pool": 1, "grpc.x": i}) as s:
            answer = await s.ModelInfer(infer_request(x))
            np.testing.assert_allclose(output_of(answer), demo_reference(x), rtol=1e-5, atol=1e-5)
        sent += 3
    # The engine counts every front's requests once: statistics and /metrics agree, whichever front answers.
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        stats = (await client.get("/v2/models/demo/stats")).json()["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == sent
        page = (await client.get("/metrics")).text
        assert metric_value(page, "ffn_request_seconds_count", model="demo") == sent
        assert "ffn_build_info{" in page  # a front answers the scrape, torch unloaded
    assert not any(maps_libtorch(pid) for pid in server.worker_pids() if pid != engine_pid(server))


async def test_a_killed_engine_fails_in_flight_requests_and_the_service_serves_after_its_restart(
    tmp_path: Path,
) -> None:
    config = slow_model_config(tmp_path, "max_batch_rows = 4096", with_demo=True)
    with start_server(env={"FFN_WORKERS": "2", **SHARED}, config=config) as server:
        await answers_through_both_doors(server, 2)  # two fronts, as three above
        first_engine = engine_pid(server)
        slow = np.ones((4096, D_MODEL), dtype=np.float32)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            in_flight = asyncio.create_task(
                client.post("/v1/models/slow/transform", content=slow.tobytes(), headers=raw_headers(slow.shape))
            )
            page = ""
            while metric_value(page, "ffn_queue_seconds_count", model="slow") < 1:  # in its forward pass
                await asyncio.sleep(0.02)
                page = (await client.get("/metrics")).text
            killed_at = time.monotonic()
            os.kill(first_engine, signal.SIGKILL)
            failed = await in_flight
            print(f"the in-flight request failed {time.monotonic() - killed_at:.3f} s after the kill")
            assert failed.status_code == 503 and failed.headers["retry-after"] == "1", failed.text
            assert "engine process ended" in failed.json()["error"]

            wait_for_log(server, r"engine process \(pid \d+\) was killed by SIGKILL; starting another")
            mark = len(server.logs())
            wait_for_log(server, r"engine process \(pid \d+\) ready", after=mark)
            x = rows(3, 7)
            give_up = time.monotonic() + 30
            while True:  # the fronts link again within their retry interval
                r = await client.post("/v1/models/demo/transform", content=x.tobytes(), headers=raw_headers(x.shape))
                if r.status_code == 200 or time.monotonic() > give_up:
                    break
                assert r.status_code == 503, r.text
                await asyncio.sleep(0.05)
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(
                np.frombuffer(r.content, "<f4").reshape(x.shape), demo_reference(x), rtol=1e-5, atol=1e-5
            )
            assert engine_pid(server) != first_engine

            # A front killed: replaced, and the service answers throughout.
            front = next(pid for pid in server.worker_pids() if pid != engine_pid(server))
            mark = len(server.logs())
            os.kill(front, signal.SIGKILL)
            wait_for_log(server, rf"worker (\d) \(pid {front}\) was killed by SIGKILL; starting another", after=mark)
            wait_for_log(server, r"worker \d \(pid \d+\) ready", after=mark)
            r = await client.post("/v1/models/demo/transform", content=x.tobytes(), headers=raw_headers(x.shape))
            assert r.status_code == 200, r.text
        assert server.stop() == 0


async def test_a_load_and_a_log_setting_reach_the_engine_once_and_a_drain_under_load_loses_nothing(
    tmp_path: Path,
) -> None:
    config = tmp_path / "ffn.toml"
    config.write_text('[[models]]\nname = "demo"\n')
    with start_server(env={"FFN_WORKERS": "2", "FFN_MODEL_CONTROL": "explicit", **SHARED}, config=config) as server:
        wait_for_log(server, r"ready: 2 fronts and one engine process")
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            r = await client.post("/v2/repository/models/demo/load")
            assert r.status_code == 200, r.text
        give_up = time.monotonic() + 30
        versions: set[str] = set()
        while versions != {"2"}:  # each a connection of its own: both fronts are asked
            assert time.monotonic() < give_up, versions
            versions = set()
            for _ in range(8):
                async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                    versions.add((await client.get("/v2/models/demo")).json()["versions"][0])
        async with stub(server.grpc_target) as grpc_client:  # the gRPC door's load: the same one engine
            await grpc_client.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="demo"), timeout=60)
            metadata = await grpc_client.ModelMetadata(pb.ModelMetadataRequest(name="demo"), timeout=60)
            assert list(metadata.versions) == ["3"]
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:  # a log setting: the engine too
            r = await client.post("/v2/logging", json={"log_verbose_level": 1})
            assert r.status_code == 200 and r.json()["log_verbose_level"] == 1, r.text
        applied = [line for line in server.logs().splitlines() if "log settings now" in line]
        assert sorted(re.findall(r"\[worker (\d)\]", "\n".join(applied))) == ["0", "1", "2"], applied
        # Loaded in the engine alone (its lines are "[worker 0]"), once at start and once by each load.
        loaded = [line for line in server.logs().splitlines() if "loaded model demo" in line]
        retired = [line for line in server.logs().splitlines() if re.search(r"version [12] retiring", line)]
        assert len(loaded) == 1 and len(retired) == 2, server.logs()
        assert all("[worker 0]" in line for line in loaded + retired)
        await drain_under_load(server)


async def drain_under_load(server: ServerProcess) -> None:
    """SIGTERM with six clients sending, as tests/test_workers.py's drain: every request sent before
    the signal is answered, 200 (right) or 503; one sent after it may also find the port closing
    (refused, or reset where the last front closed the shared listening socket); the exit code is 0."""
    outcomes: list[tuple[float, str]] = []  # (sent at, outcome)
    stop = asyncio.Event()

    async def client_loop(seed: int) -> None:
        x = rows(2, seed)
        while not stop.is_set():
            at = time.monotonic()
            try:
                async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                    r = await client.post(
                        "/v1/models/demo/transform", content=x.tobytes(), headers=raw_headers(x.shape)
                    )
            except httpx.TransportError as exc:
                outcomes.append((at, type(exc).__name__))
                await asyncio.sleep(0.01)
                continue
            if r.status_code == 200:
                np.testing.assert_allclose(
                    np.frombuffer(r.content, "<f4").reshape(x.shape), demo_reference(x), rtol=1e-5, atol=1e-5
                )
            else:
                assert r.status_code == 503 and r.json()["error_type"] == "unavailable", r.text
            outcomes.append((at, str(r.status_code)))

    clients = [asyncio.create_task(client_loop(seed)) for seed in range(6)]
    while sum(outcome == "200" for _, outcome in outcomes) < 30:
        await asyncio.sleep(0.02)
    sigterm_at = time.monotonic()
    server.terminate()
    code = await asyncio.to_thread(server.wait, 60)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*clients), 60)
    assert code == 0, server.logs()
    before = [outcome for at, outcome in outcomes if at < sigterm_at]
    assert len(before) >= 30 and set(before) <= {"200", "503"}, Counter(before)
    after = [outcome for at, outcome in outcomes if at >= sigterm_at]
    assert set(after) <= {"200", "503", "ConnectError", "RemoteProtocolError", "ReadError"}, Counter(after)
    assert "still running after the drain timeout" not in server.logs()


async def test_two_engines_share_the_work_and_a_load_a_log_setting_and_a_killed_engine_reach_both(
    tmp_path: Path,
) -> None:
    """`devices` = cpu twice: two engine processes (libtorch in them alone); requests spread over both,
    answers equal to numpy; a model load and a log setting applied by each, SIGHUP's reading of the
    config file by one; one engine killed, the fronts serve through the other while it restarts, and
    it serves the loaded version again."""
    config = tmp_path / "ffn.toml"
    config.write_text('[[models]]\nname = "demo"\n')
    env = {"FFN_WORKERS": "2", "FFN_DEVICES": '["cpu", "cpu"]', "FFN_MODEL_CONTROL": "explicit", **SHARED}
    with start_server(env=env, config=config) as server:
        wait_for_log(server, r"ready: 2 fronts and 2 engine processes \(cpu, cpu\)")
        engines = {
            int(k): int(pid)
            for k, pid in re.findall(r"engine process (\d) \(cpu\) started \(pid (\d+)\)", server.logs())
        }
        assert sorted(engines) == [0, 1]
        assert sorted(pid for pid in server.worker_pids() if maps_libtorch(pid)) == sorted(engines.values())

        before = {k: cpu_seconds(pid) for k, pid in engines.items()}
        inputs = [rows(256, seed) for seed in range(24)]
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            answers = await asyncio.gather(
                *(
                    client.post("/v1/models/demo/transform", content=x.tobytes(), headers=raw_headers(x.shape))
                    for x in inputs
                )
            )
            for x, r in zip(inputs, answers, strict=True):
                assert r.status_code == 200, r.text
                np.testing.assert_allclose(
                    np.frombuffer(r.content, "<f4").reshape(x.shape), demo_reference(x), rtol=1e-5, atol=1e-5
                )
            # Each engine computed a share: 24 requests of 256 rows (1 GFLOP each) took 0.47 s of CPU
            # here, split 0.25 and 0.22; an idle engine spends milliseconds on its heartbeats meanwhile.
            spent = {k: cpu_seconds(pid) - before[k] for k, pid in engines.items()}
            assert min(spent.values()) >= sum(spent.values()) / 4 and sum(spent.values()) > 0.1, spent
            # The model series sum both engines' work, whichever front answers the scrape.
            page = (await client.get("/metrics")).text
            assert metric_value(page, "ffn_request_seconds_count", model="demo") == 24
            assert metric_value(page, "ffn_batch_rows_sum", model="demo") == 24 * 256
            stats = (await client.get("/v2/models/demo/stats")).json()["model_stats"][0]
            assert stats["inference_stats"]["success"]["count"] == 24

            r = await client.post("/v2/repository/models/demo/load")
            assert r.status_code == 200, r.text
            assert (await client.get("/v2/models/demo")).json()["versions"] == ["2"]
            r = await client.post("/v2/logging", json={"log_verbose_level": 1})
            assert r.status_code == 200, r.text
        for pattern in (r"\[worker (\d)\] .*version 1 retiring", r"\[worker (\d)\] .*log settings now"):
            said_by = sorted(re.findall(pattern, server.logs()))
            expected = ["0", "3"] if "retiring" in pattern else ["0", "1", "2", "3"]  # engines 0 and 1 are slots 0, 3
            assert said_by == expected, (pattern, server.logs())

        mark = len(server.logs())
        server.proc.send_signal(signal.SIGHUP)  # one engine reads the file; its loads (none here) reach both
        wait_for_log(server, r"received SIGHUP: engine process 0 \(cpu\) reads the config file again", after=mark)
        wait_for_log(server, r"\[worker 0\] .*SIGHUP: config file .* read again", after=mark)
        killed_at = mark = len(server.logs())
        os.kill(engines[0], signal.SIGKILL)
        for _ in range(2):  # both fronts see its link end, and send to engine 1 alone until it is back
            mark = wait_for_log(server, r"the link to engine process 0 ended", after=mark).end() + mark
        x = rows(5, 11)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            assert (await client.get("/v2/health/ready")).status_code == 200
            for _ in range(10):
                r = await client.post("/v1/models/demo/transform", content=x.tobytes(), headers=raw_headers(x.shape))
                assert r.status_code == 200, r.text
                np.testing.assert_allclose(
                    np.frombuffer(r.content, "<f4").reshape(x.shape), demo_reference(x), rtol=1e-5, atol=1e-5
                )
        # Restarted, it loads the configured version 1, and the load made since is replayed before it
        # serves: it serves version 2, as engine 1 does.
        wait_for_log(server, r"engine process 0 \(cpu\) \(pid \d+\) ready", after=killed_at)
        assert re.search(r"\[worker 0\] .*version 1 retiring", server.logs()[killed_at:]), server.logs()[killed_at:]
        assert not re.search(r"\[worker 3\] .*SIGHUP", server.logs()), "engine 1 was sent SIGHUP too"
        assert server.stop() == 0


def cpu_seconds(pid: int) -> float:
    """The process's user and system CPU time so far, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_device_that_is_not_there_stops_the_start_naming_it() -> None:
    """`devices` naming a GPU this host lacks (no CUDA here; on a GPU host, no 100th GPU): that engine
    cannot load its models, and the service stops (the front may have served through engine 0 until
    then, as a plain worker serves while another fails to start), its log naming the device."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")}
    env |= {"FFN_WORKERS": "1", "FFN_DEVICES": '["cpu", "cuda:99"]', "FFN_GRPC": "false", **SHARED}
    command = [sys.executable, "-m", "app.cli", "--host", "127.0.0.1", "--port", str(free_port())]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode != 0, result.stderr
    if "is built without it" in result.stderr:  # a torch without CUDA: refused before any process starts
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("ffn-serve: setting devices: device 'cuda:99' needs CUDA"), result.stderr
        assert "engine process" not in result.stderr, result.stderr
        return
    assert "device 'cuda:99' requested but" in result.stderr, result.stderr
    stopping = r"engine process 1 \(cuda:99\) \(pid \d+\) exited with code \d+ while starting: stopping the service"
    assert re.search(stopping, result.stderr), result.stderr
