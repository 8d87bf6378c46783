"""The gRPC door's life in the process: drain on SIGTERM, every worker on the one port, a port in use, turned off."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2 as pb

from app.config.settings import GRPC_PORT_FIX
from app.process.preflight import ANOTHER_SERVER
from ffn_testing import free_port, metric_value, start_server, wait_for_metrics
from tests.grpc_helpers import D_MODEL, infer_request, output_of, stub
from tests.reference import demo_reference
from tests.slow_model import slow_model_config
from tests.test_overload import metrics

CLI = [sys.executable, "-m", "app.cli"]


@pytest.mark.server
async def test_sigterm_finishes_calls_in_flight_and_refuses_new_ones_unavailable(tmp_path: Path) -> None:
    config = slow_model_config(tmp_path, "max_wait_ms = 0\nmax_batch_rows = 4096\nwarmup = false")
    with start_server(config=config) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http, stub(server.grpc_target) as s:
            before = await metrics(http)
            in_flight = asyncio.ensure_future(s.ModelInfer(infer_request(np.ones((3072, D_MODEL), np.float32), "slow")))
            await wait_for_metrics(
                http,
                lambda m: (
                    metric_value(m, "ffn_queue_seconds_count", model="slow")
                    > metric_value(before, "ffn_queue_seconds_count", model="slow")
                ),
                "the in-flight call's forward pass to start",
            )
            server.terminate()
            refusals = []
            while True:  # until the drain shows: readiness false, then new work refused
                try:
                    if not (await s.ServerReady(pb.ServerReadyRequest())).ready:
                        break
                except grpc.aio.AioRpcError as exc:
                    refusals.append(exc.code())
                    break
                await asyncio.sleep(0.02)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await s.ModelInfer(infer_request(np.ones((2, D_MODEL), np.float32), "slow"))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            if not refusals:  # still draining: the engine's refusal, with its reason
                assert info.value.details() == "model 'slow' is not ready: draining before shutdown"
            answer = await in_flight  # accepted before the signal: answered in full
            assert output_of(answer).shape == (3072, D_MODEL)
        assert server.wait(60) == 0, server.logs()


@pytest.mark.server
async def test_health_is_not_serving_while_draining(tmp_path: Path) -> None:
    config = slow_model_config(tmp_path, "max_wait_ms = 0\nmax_batch_rows = 4096\nwarmup = false")
    with start_server(config=config) as server:
        async with grpc.aio.insecure_channel(server.grpc_target) as channel, stub(server.grpc_target) as s:
            health = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            # Four passes of a second or so each, all accepted before the drain begins: the drain is
            # still going when the checks below ask (the door closes only once it has finished).
            big = infer_request(np.ones((3072, D_MODEL), np.float32), "slow")
            in_flight = asyncio.gather(*(s.ModelInfer(big) for _ in range(4)))

            def all_four_taken(m: str) -> bool:
                started = metric_value(m, "ffn_queue_seconds_count", model="slow")
                return started >= 1 and started + metric_value(m, "ffn_queue_rows", model="slow") / 3072 >= 4

            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                await wait_for_metrics(http, all_four_taken, "the four requests to be taken")
            server.terminate()
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            check = await health.Check(health_pb2.HealthCheckRequest(service="slow"))
            assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert all(output_of(answer).shape == (3072, D_MODEL) for answer in await in_flight)
        assert server.wait(60) == 0, server.logs()


def listening_sockets(port: int) -> set[int]:
    """Inodes of the sockets listening on `port` (any address), from /proc/net/tcp and tcp6."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(int(fields[9]))
    return inodes


def socket_inodes(pid: int) -> set[int]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


@pytest.mark.server
async def test_every_worker_serves_grpc_on_the_one_port() -> None:
    with start_server(env={"FFN_WORKERS": "2"}) as server:
        assert server.grpc_port is not None
        give_up = asyncio.get_running_loop().time() + 180
        while "ready: 2 workers" not in server.logs():  # ready answers once one worker is; wait for both
            assert server.proc.poll() is None and asyncio.get_running_loop().time() < give_up, server.logs()
            await asyncio.sleep(0.05)
        listening = listening_sockets(server.grpc_port)
        holders = {pid: socket_inodes(pid) & listening for pid in server.worker_pids()}
        serving = [pid for pid, held in holders.items() if held]
        assert len(serving) == 2 and len(listening) == 2, (holders, listening)  # one listener in each worker
        assert not socket_inodes(server.pid) & listening, "the supervisor holds the port but never listens"
        x = np.random.default_rng(1).standard_normal((3, D_MODEL)).astype(np.float32)
        for i in range(16):  # a connection each: the kernel spreads them over the workers
            async with stub(server.grpc_target, **{"grpc.use_local_subchannel_pool": 1, "grpc.x": i}) as s:
                answer = await s.ModelInfer(infer_request(x))
                np.testing.assert_allclose(output_of(answer), demo_reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_grpc_port_in_use_exits_3_before_loading_anything(workers: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--port", str(free_port()), "--grpc-port", str(port), "--workers", workers, "--log-format", "json"]
        result = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 3, result.stderr
    assert result.stderr.splitlines() == [
        f"ffn-serve: cannot listen on 127.0.0.1:{port} (gRPC): Address already in use: {ANOTHER_SERVER}; {GRPC_PORT_FIX}"
    ]


@pytest.mark.server
def test_a_grpc_port_another_ffn_serve_serves_is_in_use() -> None:
    """grpc listens with SO_REUSEPORT; a second service must still not share its port."""
    with start_server(env={"FFN_LOG_LEVEL": "warning"}) as first:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")}
        args = ["--port", str(free_port()), "--grpc-port", str(first.grpc_port)]
        result = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 3, result.stderr
    assert (
        f"cannot listen on 127.0.0.1:{first.grpc_port} (gRPC): Address already in use: {ANOTHER_SERVER}; {GRPC_PORT_FIX}"
        in result.stderr
    )


@pytest.mark.server
def test_grpc_can_be_turned_off() -> None:
    with start_server(env={"FFN_GRPC": "false", "FFN_LOG_LEVEL": "info"}) as server:
        assert server.grpc_port is None
        assert "gRPC" not in server.logs()
        port = int(server.logs().split("listening on http://127.0.0.1:")[1].split()[0])
        assert port == server.port
        listening = set().union(*(listening_sockets(p) for p in (8001, int(os.environ.get("UNUSED", "8001")))))
        assert not listening & socket_inodes(server.pid), "nothing of this server listens on a gRPC port"


@pytest.mark.server
def test_grpc_port_0_is_a_free_port_the_log_names() -> None:
    with start_server(env={"FFN_GRPC_PORT": "0", "FFN_LOG_LEVEL": "info"}) as server:
        line = next(line for line in server.logs().splitlines() if "gRPC (inference.GRPCInferenceService" in line)
        port = int(line.rsplit(":", 1)[1])
        assert port > 0 and listening_sockets(port) & socket_inodes(server.pid)
