"""Worker processes (FFN_WORKERS=2): real servers, real signals, real sockets.

Both workers serve; /metrics counts the whole service on every scrape, whichever worker answers
it, and without the key on the metrics port; a SIGKILLed worker is replaced while the other
keeps answering (and readiness never falters: a worker accepts nothing until warm); SIGTERM
under load loses nothing and exits 0; a worker that cannot load its model stops the start with
its exit code, and nothing is restarted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.observe.logs import JsonFormatter, configure_logging
from ffn_testing import (
    ServerProcess,
    free_port,
    http_request,
    metric_value,
    raw_request,
    start_server,
    wait_for_metrics,
)
from tests.exposition import value_as_written
from tests.reference import demo_reference
from tests.slow_model import slow_model_config
from tests.wire import raw_headers

pytestmark = pytest.mark.server  # every test here starts ffn-serve processes

KEY = "workers-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
D_MODEL = 512
SLOW_ROWS = 2048  # of the slow model: a pass under way at SIGTERM, and a 4 MiB answer
ACCESS_LINE = re.compile(r"\[worker (\d+)\] uvicorn\.access: .*\"POST /v1/models/demo/transform HTTP/1\.1\" 200")


# Runs a command as a child subreaper (PR_SET_CHILD_SUBREAPER, 36; kept across the exec): orphans of
# its descendants become its children, as they become PID 1's in a container, where ffn-serve is PID 1.
AS_SUBREAPER = [
    sys.executable,
    "-c",
    "import ctypes, os, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:\n"
    "    sys.exit(f'prctl: errno {ctypes.get_errno()}')\n"
    "os.execv(sys.argv[1], sys.argv[1:])",
]


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[ServerProcess, int]]:
    """Two workers behind an API key, with an access log and a metrics port: (server, metrics port).
    The supervisor is a subreaper, as PID 1 in a container is: what it leaves unwaited stays a zombie."""
    metrics_port = free_port()
    env = {"FFN_WORKERS": "2", "FFN_API_KEY": KEY, "FFN_METRICS_PORT": str(metrics_port), "FFN_ACCESS_LOG": "true"}
    with start_server(env=env, prefix=AS_SUBREAPER) as server:
        yield server, metrics_port


async def transform(port: int, x: np.ndarray) -> np.ndarray:
    """One raw float32 request on a connection of its own (each new connection may go to either worker)."""
    request = http_request("POST", "/v1/models/demo/transform", {**AUTH, **raw_headers(x.shape)}, x.tobytes())
    response = await raw_request(port, request)
    assert response.status == 200, response.body
    return np.frombuffer(response.body, "<f4").reshape(x.shape)


async def send_checked(port: int, count: int, seed: int) -> int:
    """`count` concurrent requests of 1-8 rows, each answer checked against numpy; the rows sent."""
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal((int(rng.integers(1, 9)), D_MODEL)).astype(np.float32) for _ in range(count)]
    outputs = await asyncio.gather(*(transform(port, x) for x in inputs))
    for x, y in zip(inputs, outputs, strict=True):
        np.testing.assert_allclose(y, demo_reference(x), rtol=1e-4, atol=1e-4)
    return sum(x.shape[0] for x in inputs)


def scrape(url: str, headers: dict[str, str] | None = None) -> str:
    response = httpx.get(url + "/metrics", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return response.text


def successes(url: str) -> int:
    """The V2 statistics extension's count of the demo model's successful requests."""
    response = httpx.get(url + "/v2/models/demo/stats", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    (stats,) = response.json()["model_stats"]
    count: int = stats["inference_stats"]["success"]["count"]
    return count


def worker_pids(page: str) -> set[int]:
    """The worker pids the process metrics list."""
    return {
        int(sample.labels["pid"])
        for family in text_string_to_metric_families(page)
        if family.name == "process_resident_memory_bytes"
        for sample in family.samples
        if sample.labels["role"] == "worker"
    }


def replaced(logs: str, pid: int) -> bool:
    """Whether the log shows worker `pid` killed, then a worker ready after it."""
    _, _, after = logs.partition(f"(pid {pid}) was killed by SIGKILL")
    return bool(after) and re.search(r"worker \d \(pid \d+\) ready", after) is not None


def served_by(logs: str) -> Counter[int]:
    """Answered transform requests per worker number, from the access log."""
    return Counter(int(m.group(1)) for m in ACCESS_LINE.finditer(logs))


async def test_both_workers_serve(workers: tuple[ServerProcess, int]) -> None:
    server, _ = workers
    for round_ in range(30):  # which worker accepts a connection is the kernel's choice: a few rounds
        await send_checked(server.port, 16, seed=round_)
        if len(served_by(server.logs())) == 2:
            break
    assert set(served_by(server.logs())) == {1, 2}, server.logs()
    page = scrape(server.url, AUTH)
    assert len(worker_pids(page)) == 2
    assert metric_value(page, "process_resident_memory_bytes", pid=str(server.pid), role="supervisor") > 0
    # torch threads: the cores this process (and so the server) may use, shared out between the workers.
    assert f"ready: 2 workers, {max(1, len(os.sched_getaffinity(0)) // 2)} torch threads each" in server.logs()
    # torch is loaded where the models are, never in the supervisor, which only watches the workers.
    assert not torch_loaded(server.pid), "the supervisor loaded torch"
    assert all(torch_loaded(int(pid)) for pid in worker_pids(page))


def torch_loaded(pid: int) -> bool:
    """Whether the process has torch's shared library mapped (what `import torch` loads)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


async def test_metrics_count_every_request_on_every_scrape(workers: tuple[ServerProcess, int]) -> None:
    server, metrics_port = workers
    metrics_url = f"http://127.0.0.1:{metrics_port}"
    before = scrape(server.url, AUTH)
    stats_before = successes(server.url)
    sent = 60
    rows = 0
    for seed in range(sent // 12):
        rows += await send_checked(server.port, 12, seed=100 + seed)
    for i in range(8):  # each scrape is answered by whichever worker accepts it
        page = scrape(metrics_url) if i % 2 else scrape(server.url, AUTH)
        for name, expected in (
            ("ffn_requests_total", sent),
            ("ffn_request_rows_count", sent),
            ("ffn_request_rows_sum", rows),
        ):
            labels = {"model": "demo", **({"outcome": "ok"} if name == "ffn_requests_total" else {})}
            delta = metric_value(page, name, **labels) - metric_value(before, name, **labels)
            assert delta == expected, f"scrape {i}: {name} grew by {delta}, {expected} were sent"
        # Triton's names, written from the same merged samples: as exact (rows computed = rows sent).
        for name, expected in (("nv_inference_request_success", sent), ("nv_inference_count", rows)):
            delta = value_as_written(page, name, model="demo", version="1") - value_as_written(before, name)
            assert delta == expected, f"scrape {i}: {name} grew by {delta}, {expected} were sent"
        assert metric_value(page, "ffn_queue_rows", model="demo") == 0  # a live-sum gauge, nothing waiting
        # The V2 statistics extension reads the same merged samples, whichever worker answers.
        assert successes(server.url) - stats_before == sent
    # The key still guards the main port's /metrics; the metrics port needs none and serves nothing else.
    assert httpx.get(server.url + "/metrics").status_code == 401
    other = httpx.get(metrics_url + "/v1/models")
    assert other.status_code == 404 and other.json()["error_type"] == "not_found"


async def test_a_killed_worker_is_replaced_while_the_other_answers(workers: tuple[ServerProcess, int]) -> None:
    server, _ = workers
    before = scrape(server.url, AUTH)
    pids = worker_pids(before)
    assert len(pids) == 2
    victim = min(pids)
    os.kill(victim, signal.SIGKILL)
    sent = 0
    readiness: list[int] = []
    for _ in range(600):  # until the replacement is up: far longer than a worker's start
        await send_checked(server.port, 4, seed=sent)
        sent += 4
        # On a new connection each time: answered by whichever worker accepts it.
        readiness.append((await raw_request(server.port, http_request("GET", "/v2/health/ready"))).status)
        if replaced(server.logs(), victim) and len(worker_pids(scrape(server.url, AUTH)) - {victim}) == 2:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError(f"worker {victim} was not replaced; log:\n{server.logs()}")
    assert set(readiness) == {200}, "readiness answered by a warm worker only"
    logs = server.logs()
    assert re.search(rf"worker \d \(pid {victim}\) was killed by SIGKILL; starting another in 0\.5 s", logs), logs
    page = scrape(server.url, AUTH)
    assert metric_value(page, "ffn_worker_restarts_total") == 1
    # The dead worker's counts are kept: the total is everything ever answered.
    grown = metric_value(page, "ffn_requests_total", model="demo", outcome="ok") - metric_value(
        before, "ffn_requests_total", model="demo", outcome="ok"
    )
    assert grown == sent


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def fork_server_of(server: ServerProcess) -> int:
    """The one process the workers were forked from: a child of the supervisor, not the supervisor."""
    parents = {parent_of(pid) for pid in server.worker_pids()}
    assert len(parents) == 1, parents
    (fork_server,) = parents
    assert fork_server != server.pid and parent_of(fork_server) == server.pid
    return fork_server


async def request_id_prefixes(port: int) -> set[str]:
    """The request-id prefixes the workers give (12 hex digits, one per process), over new connections
    until two are seen (which worker accepts a connection is the kernel's choice)."""
    prefixes: set[str] = set()
    for _ in range(30):
        responses = await asyncio.gather(
            *(raw_request(port, http_request("GET", "/v2/health/ready")) for _ in range(16))
        )
        prefixes |= {response.headers["x-request-id"][:12] for response in responses}
        if len(prefixes) >= 2:
            break
    return prefixes


async def test_the_workers_are_forked_from_one_fork_server_that_imported_torch(
    workers: tuple[ServerProcess, int],
) -> None:
    # A worker starts from a process that imported torch once (app/process/supervisor.py), not from a fresh
    # interpreter, and yet each draws its own request ids.
    server, _ = workers
    fork_server = fork_server_of(server)
    assert torch_loaded(fork_server) and not torch_loaded(server.pid)
    assert len(await request_id_prefixes(server.port)) == 2
    await send_checked(server.port, 8, seed=7)


async def test_a_killed_fork_server_has_its_workers_drained_and_replaced(workers: tuple[ServerProcess, int]) -> None:
    server, _ = workers
    give_up = time.monotonic() + 180
    while "ready: 2 workers" not in server.logs():  # both serve: a worker lost while starting stops the service
        assert time.monotonic() < give_up and server.proc.poll() is None, server.logs()
        await asyncio.sleep(0.05)
    old_workers, fork_server = server.worker_pids(), fork_server_of(server)
    assert len(old_workers) == 2
    ready_before = server.logs().count(") ready")
    os.kill(fork_server, signal.SIGKILL)
    # Every child of a dead fork server reads as exited: the supervisor says what happened, asks
    # those workers to drain (they exit by themselves) and starts others from a new fork server.
    give_up = time.monotonic() + 180
    while not (len(server.worker_pids() - old_workers) == 2 and server.logs().count(") ready") >= ready_before + 2):
        assert time.monotonic() < give_up and server.proc.poll() is None, server.logs()
        await asyncio.sleep(0.1)
    for pid in old_workers:
        assert f"(pid {pid}) lost its fork server (killed?) and is asked to drain; starting another" in server.logs()
    # Drained, and waited for: not left running, nor a zombie of the supervisor (their parent now).
    while any(Path(f"/proc/{pid}").exists() for pid in old_workers):
        assert time.monotonic() < give_up, f"workers {old_workers} still run"
        await asyncio.sleep(0.1)
    assert fork_server_of(server) != fork_server
    await send_checked(server.port, 16, seed=11)
    assert len(await request_id_prefixes(server.port)) == 2


@pytest.fixture(scope="module")
def drain_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("workers-drain")
    return slow_model_config(folder, "warmup = false\nmax_batch_rows = 4096\ndrain_timeout_s = 30", with_demo=True)


async def test_sigterm_under_load_loses_nothing_and_exits_0(drain_config: Path) -> None:
    with start_server(config=drain_config, env={"FFN_WORKERS": "2"}) as server:
        # Both workers warm first: the test counts two drains, and one worker answering is enough to
        # be "ready" (on a busy machine the second was still loading when the signal came).
        give_up = time.monotonic() + 120  # a bound, so that a hang fails instead
        while "ready: 2 workers" not in server.logs():
            assert time.monotonic() < give_up, f"the second worker never became ready; log:\n{server.logs()}"
            await asyncio.sleep(0.05)
        outcomes: list[tuple[float, str]] = []  # (sent at, outcome) of every request
        answers: list[tuple[np.ndarray, np.ndarray]] = []  # (x, y) of every 200, checked after the run
        stop = asyncio.Event()

        async def load(seed: int) -> None:
            rng = np.random.default_rng(seed)
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                while not stop.is_set():
                    x = rng.standard_normal((int(rng.integers(1, 9)), D_MODEL)).astype(np.float32)
                    at = time.monotonic()
                    try:
                        r = await client.post(
                            "/v1/models/demo/transform", content=x.tobytes(), headers=raw_headers(x.shape)
                        )
                    except httpx.TransportError as exc:
                        outcomes.append((at, type(exc).__name__))
                        return
                    outcomes.append((at, str(r.status_code)))
                    if r.status_code != 200:
                        return
                    answers.append((x, np.frombuffer(r.content, "<f4").reshape(x.shape)))

        clients = [asyncio.create_task(load(seed)) for seed in range(8)]
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as probe:
            # Both workers serving before the signal: the server is ready once one is, and a worker
            # still warming up when SIGTERM comes has accepted nothing, so it exits without a drain.
            for _ in range(3000):  # a bound, so that a hang fails instead
                if sum(o == "200" for _, o in outcomes) >= 40 and "ready: 2 workers" in server.logs():
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError(f"40 requests were never answered by 2 ready workers; log:\n{server.logs()}")
            # A slow request computing when the signal comes: the drain lasts at least its pass. Its
            # 4 MiB answer must be read within the server's 3 s close grace after the drain, on a
            # busy machine too: the clients check their answers only after the run, not meanwhile.
            slow_x = np.ones((SLOW_ROWS, D_MODEL), dtype=np.float32)
            slow = asyncio.create_task(
                probe.post("/v1/models/slow/transform", content=slow_x.tobytes(), headers=raw_headers(slow_x.shape))
            )
            await wait_for_metrics(
                probe,
                lambda m: metric_value(m, "ffn_queue_seconds_count", model="slow") == 1,
                "the slow request's pass started",
            )
            sigterm_at = time.monotonic()
            server.terminate()
            slow_answer = await slow
            stop.set()
            await asyncio.wait_for(asyncio.gather(*clients), timeout=90)
        code = server.wait(90)
        logs = server.logs()

    assert code == 0, logs
    assert logs.count("received SIGTERM: draining") == 2, logs  # each worker drained
    assert slow_answer.status_code == 200 and slow_answer.headers["x-shape"] == f"{SLOW_ROWS},{D_MODEL}"
    before = [outcome for at, outcome in outcomes if at < sigterm_at]
    assert len(before) >= 40
    assert set(before) <= {"200", "503"}, Counter(before)
    after = [outcome for at, outcome in outcomes if at >= sigterm_at]
    assert set(after) <= {"200", "503", "ConnectError", "RemoteProtocolError", "ReadError"}, Counter(after)
    for x, y in answers:
        np.testing.assert_allclose(y, demo_reference(x), rtol=1e-4, atol=1e-4)


def test_a_worker_that_cannot_load_stops_the_start(tmp_path: Path) -> None:
    # A file there but not weights: a missing one is refused before any worker starts (app/process/preflight.py).
    (tmp_path / "broken.safetensors").write_bytes(b"not a safetensors file")
    (tmp_path / "bad.toml").write_text('[[models]]\nname = "broken"\nweights = "broken.safetensors"\n')
    # A short TMPDIR of its own: multiprocessing's fork server binds a Unix socket inside it, whose path
    # may not pass 107 bytes (a pytest tmp_path deep in a machine's hundredth run would).
    scratch = Path(tempfile.mkdtemp(prefix="w", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")} | {"TMPDIR": str(scratch)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "--config",
            str(tmp_path / "bad.toml"),
            "--port",
            str(free_port()),
            "--grpc-port",
            "0",
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 1, result.stderr
    assert "broken.safetensors" in result.stderr and "'broken'" in result.stderr
    assert "while starting: stopping the service" in result.stderr
    assert result.stderr.count("started (pid") == 2, "each worker starts once: no restart"
    assert "starting another" not in result.stderr
    assert list(scratch.iterdir()) == [], "the metrics folder is removed"
    scratch.rmdir()


def test_a_metrics_port_in_use_exits_3() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "app.cli",
                "--port",
                str(free_port()),
                "--grpc-port",
                "0",
                "--metrics-port",
                str(port),
                "--workers",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 3
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "started (pid" not in result.stderr


def test_a_workers_log_records_name_it() -> None:
    """Text lines carry `[worker N]`, JSON objects `worker` and `pid`: several processes share one stream."""

    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "served %s", ("x",), None)
    entry = json.loads(JsonFormatter(worker=3).format(record))
    assert entry["worker"] == 3 and entry["pid"] == os.getpid() and entry["message"] == "served x"
    assert "worker" not in json.loads(JsonFormatter().format(record))
    root = logging.getLogger()
    saved = root.handlers, root.level
    try:
        configure_logging("info", "text", worker=2)
        line = root.handlers[0].format(record)
    finally:
        root.handlers, root.level = saved[0], saved[1]
    assert line.endswith(" INFO [worker 2] uvicorn.access: served x"), line


# A server that has imported WORKER_PRELOAD, as the supervisor's fork server has, then runs app.cli
# until it is ready, and prints the modules it imported on the way: what a forked worker would
# still import after the fork, each time, at its own cost.
IMPORTED_AFTER_PRELOAD = """
import importlib, json, os, signal, sys, threading, time, urllib.request
from app.process.supervisor import WORKER_PRELOAD
for module in WORKER_PRELOAD:
    importlib.import_module(module)
import app.cli
before = set(sys.modules)
port = sys.argv[1]

def report_when_ready():
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5)
            break
        except OSError:
            time.sleep(0.05)
    print(json.dumps(sorted(set(sys.modules) - before)), flush=True)
    print(json.dumps(sorted(name for name in before if name.startswith(("huggingface_hub", "opentelemetry.sdk")))), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=report_when_ready, daemon=True).start()
sys.exit(app.cli.main(["--host", "127.0.0.1", "--port", port]))
"""


def test_the_fork_server_imports_all_of_ours_and_torch_that_a_worker_needs() -> None:
    # Before: app.process.server stopped importing torch (the doors import none), and every forked start
    # paid for torch again, unnoticed.
    run = subprocess.run(
        [sys.executable, "-c", IMPORTED_AFTER_PRELOAD, str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr
    imported = json.loads(run.stdout.splitlines()[0])
    assert imported, "nothing imported after the preload: the probe did not run a server"
    ours = [name for name in imported if name.split(".")[0] in ("app", "ffn_core", "torch", "numpy", "grpc")]
    assert ours == [], ours
    # The suite's fork server (tests/forkserver.py) preloads the same, and forks starts whose HF_* or
    # OTEL_* variables differ from its own (READ_WHEN_USED): right only while the preload loads neither
    # library, which read those variables when they load or build their exporter.
    assert json.loads(run.stdout.splitlines()[1]) == []
