"""The hand-off's memory in a real layout (`shared_engine`, issue 40): private, leak-free, and a clear start.

- With the shared-memory extension on, nothing of the server's memory can be registered as a region:
  every /dev/shm name and every descriptor any process of the tree holds is tried, and refused; good
  requests stay right beside a client writing into every region it could register.
- A front killed with SIGKILL leaves nothing once its replacement is ready, a killed engine is
  restarted and answers right, and a SIGTERM then stops the service cleanly: exit 0, nothing of it
  in /dev/shm, every log line in the log format (JSON), no traceback.
- Under Docker's 64 MiB /dev/shm (a tmpfs of that size mounted in the server's own mount namespace)
  the layout serves; a start without the memory its slots need stops at once, in one line.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.utils.shared_memory as shm

from app.handoff.memory import NAME
from ffn_testing import ServerProcess, free_ports, process_tree, start_server
from tests.reference import demo_reference
from tests.wire import raw_headers
from tests.worker_logs import pids_that_served, records, replaced, worker_pids

pytestmark = pytest.mark.server

D_MODEL = 512
LAYOUT = {"FFN_SHARED_ENGINE": "true", "FFN_WORKERS": "2", "FFN_WARMUP": "false", "FFN_TORCH_THREADS": "1"}
SHM = Path("/dev/shm")
TRANSFORM = "/v1/models/demo/transform"
# The server in a mount namespace of its own, over a tmpfs of Docker's default size on /dev/shm.
SMALL_SHM = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"', "sh"]


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, D_MODEL)).astype(np.float32)


def until(condition: Callable[[], bool], what: str, seconds: float = 120.0) -> None:
    """A bounded wait (wide: the machine is shared) for `condition`, failing with `what`."""
    give_up = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < give_up, f"timed out waiting for {what}"
        time.sleep(0.1)


def blocks_mapped(pid: int) -> int:
    """How many hand-off blocks process `pid` maps (one mapping each)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except FileNotFoundError:
        return 0
    return sum(f"/memfd:{NAME} " in line for line in maps.splitlines())


def what_the_tree_holds(server: ServerProcess) -> tuple[set[str], list[str], int]:
    """Of every process of the server's tree: the /dev/shm names its mappings show, its descriptors'
    /proc paths and the names their links show, and how many hand-off blocks it maps in all."""
    names: set[str] = set()
    keys: list[str] = []
    blocks = 0
    for pid in process_tree(server.pid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            fds = os.listdir(f"/proc/{pid}/fd")
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in maps:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) == 6 else ""
            if path.startswith(f"{SHM}/"):
                names.add(path.removeprefix(f"{SHM}/").removesuffix(" (deleted)"))
            if path.startswith(f"/memfd:{NAME} "):
                blocks += 1
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            keys.append(f"/proc/{pid}/fd/{fd}")
            if target.startswith(f"{SHM}/"):
                names.add(target.removeprefix(f"{SHM}/").removesuffix(" (deleted)"))
            elif target.startswith("/memfd:"):
                keys += [target, target.removesuffix(" (deleted)"), target.lstrip("/").removesuffix(" (deleted)")]
    return names, keys, blocks


def transform(client: httpx.Client, x: np.ndarray) -> np.ndarray:
    r = client.post("/v1/models/demo/transform", content=x.tobytes(), headers=raw_headers(x.shape))
    assert r.status_code == 200, r.text
    return np.frombuffer(r.content, "<f4").reshape(x.shape)


def assert_right(x: np.ndarray, y: np.ndarray) -> None:
    np.testing.assert_allclose(y, demo_reference(x), rtol=1e-5, atol=1e-5)


def test_no_object_of_the_server_s_memory_is_a_region_and_good_requests_stay_right() -> None:
    env = {**LAYOUT, "FFN_SHARED_MEMORY": "true"}
    with start_server(env=env, ready_timeout=180) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        x = rows(4, 1)
        for _ in range(8):  # new connections: every front links, and maps its block
            assert_right(x, transform(httpx.Client(base_url=server.url, timeout=60), x))
        until(lambda: what_the_tree_holds(server)[2] >= 4, "each front's block mapped by it and the engine")
        names, keys, blocks = what_the_tree_holds(server)
        # The hand-off's memory has no name in /dev/shm; what multiprocessing opened there (its
        # semaphores) is unlinked once made. Each is tried, as every descriptor any process holds.
        tried = [f"/{name}" for name in sorted(names)] + keys
        assert len(keys) > 20 and blocks >= 4
        for k, key in enumerate(tried):
            r = client.post(
                f"/v2/systemsharedmemory/region/own-{k}/register", json={"key": key, "offset": 0, "byte_size": 16}
            )
            assert r.status_code == 400, (key, r.text)
        assert client.get("/v2/systemsharedmemory/status").json() == []

        # A client writing into every region it could register (its own) while good clients infer.
        keys = [f"/ffn-hostile-{uuid.uuid4().hex[:8]}" for _ in range(4)]
        hostile = [shm.create_shared_memory_region(f"h{k}", key, 1 << 16) for k, key in enumerate(keys)]
        try:
            for k, key in enumerate(keys):
                r = client.post(f"/v2/systemsharedmemory/region/h{k}/register", json={"key": key, "byte_size": 1 << 16})
                assert r.status_code == 200, r.text
            asyncio.run(good_requests_beside_a_scribbler(server, hostile))
        finally:
            client.post("/v2/systemsharedmemory/unregister")
            for handle in hostile:
                shm.destroy_shared_memory_region(handle)


async def good_requests_beside_a_scribbler(server: ServerProcess, hostile: list) -> None:
    """8 good clients, 25 requests each, every answer right, while a thread writes noise into each
    hostile region and the hostile client sends requests whose inputs and outputs are in them."""
    stop = threading.Event()
    noise = np.random.default_rng(7).standard_normal(1 << 14).astype(np.float32)

    def scribble() -> None:
        while not stop.is_set():
            for handle in hostile:
                shm.set_shared_memory_region(handle, [noise])
                np.negative(noise, out=noise)

    scribbler = threading.Thread(target=scribble, daemon=True)
    scribbler.start()

    async def bad(k: int) -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            for i in range(25):
                region = f"h{(k + i) % 4}"
                parameters = {"shared_memory_region": region, "shared_memory_byte_size": 4 * D_MODEL * 4}
                body = {
                    "inputs": [{"name": "input", "shape": [4, D_MODEL], "datatype": "FP32", "parameters": parameters}],
                    "outputs": [{"name": "output", "parameters": parameters}],
                }
                r = await client.post("/v2/models/demo/infer", json=body)
                assert r.status_code in (200, 400), r.text  # noise may be NaN: refused, never a crash

    async def good(k: int) -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            for i in range(25):
                x = rows(1 + (k + i) % 7, 100 * k + i)
                r = await client.post("/v1/models/demo/transform", content=x.tobytes(), headers=raw_headers(x.shape))
                assert r.status_code == 200, r.text
                assert_right(x, np.frombuffer(r.content, "<f4").reshape(x.shape))

    try:
        await asyncio.gather(*(good(k) for k in range(8)), *(bad(k) for k in range(2)))
    finally:
        stop.set()
        scribbler.join(30)


def test_killed_front_killed_engine_then_a_clean_stop_leave_nothing_and_log_no_traceback() -> None:
    before = set(os.listdir(SHM))
    held: set[str] = set()
    env = {**LAYOUT, "FFN_LOG_FORMAT": "json", "FFN_ACCESS_LOG": "true"}
    with start_server(env=env, ready_timeout=180) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            engine = int(re.findall(r"engine process started \(pid (\d+)\)", server.logs())[-1])
            fronts = worker_pids(server)
            since = len(server.logs())
            x = rows(3, 2)
            assert_right(x, transform(client, x))
            for pid in fronts.values():
                until(lambda pid=pid: blocks_mapped(pid) == 1, f"front {pid} linked")  # type: ignore[misc]
            until(lambda: blocks_mapped(engine) == 2, "the engine mapping each front's block")
            held |= what_the_tree_holds(server)[0]
            # The front that served the engine's last request is the one killed: its rows were read in
            # place in that front's block, and the engine keeps nothing of them once answered.
            until(lambda: bool(pids_that_served(server, TRANSFORM, since)), "the access line of the request")
            (served,) = pids_that_served(server, TRANSFORM, since)
            (slot,) = [slot for slot, pid in fronts.items() if pid == served]

            since = len(server.logs())
            os.kill(served, signal.SIGKILL)
            replacement = replaced(server, slot, served, since)
            until(lambda: blocks_mapped(replacement) == 1, "the replacement linked")
            # Nothing of the killed front: not its process, not its block (the engine unmapped it).
            until(lambda: blocks_mapped(engine) == 2, "the engine holding the live fronts' blocks only")
            assert not Path(f"/proc/{served}").exists()

            since = len(server.logs())
            os.kill(engine, signal.SIGKILL)
            until(
                lambda: any(
                    re.fullmatch(r"engine process \(pid (\d+)\) ready", r["message"]) for r in records(server, since)
                ),
                "the engine restarted",
            )
            restarted = int(re.findall(r"engine process started \(pid (\d+)\)", server.logs())[-1])
            assert restarted != engine

            def answers_right() -> bool:
                x = rows(5, 3)
                r = client.post("/v1/models/demo/transform", content=x.tobytes(), headers=raw_headers(x.shape))
                if r.status_code == 503:  # a front not linked again yet
                    return False
                assert r.status_code == 200, r.text
                assert_right(x, np.frombuffer(r.content, "<f4").reshape(x.shape))
                return True

            until(answers_right, "an answer through the restarted engine")
            held |= what_the_tree_holds(server)[0]
        server.proc.send_signal(signal.SIGTERM)
        # 0 only if every process stopped within the drain time (past it they are killed, exit 1).
        assert server.proc.wait(120) == 0
        log = server.logs()
        messages = [r["message"] for r in records(server)]
    assert "Traceback" not in log and "KeyError" not in log, log[-3000:]
    for line in log.splitlines():  # every line through the log format, the engine's included
        assert isinstance(json.loads(line), dict), line
    for phase in (
        "received SIGTERM: stopping 2 fronts, then one engine process",
        "every front has stopped: stopping one engine process",
        f"engine process (pid {restarted}) stopped",
        "stopped: every front and engine process has exited",
    ):
        assert phase in messages, messages[-20:]
    assert not (set(os.listdir(SHM)) - before) & held  # nothing the service named is left in /dev/shm
    assert not any(name.startswith("psm_") for name in held)  # and it named no block of its own there


def small_shm_permitted() -> bool:
    try:
        done = subprocess.run([*SMALL_SHM, "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def test_the_layout_serves_under_docker_s_64_mib_dev_shm() -> None:
    if not small_shm_permitted():
        pytest.skip("no mount namespace with a tmpfs of its own here (unshare -m and mount need CAP_SYS_ADMIN)")
    env = {**LAYOUT, "FFN_WORKERS": "3"}  # three fronts: 192 MiB of slots, three times /dev/shm's size
    with start_server(env=env, prefix=SMALL_SHM, ready_timeout=180) as server:
        mounts = Path(f"/proc/{server.pid}/mountinfo").read_text().splitlines()
        assert [line for line in mounts if " /dev/shm " in line][-1].endswith("size=65536k")  # what it sees
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for i in range(6):
                x = rows(2 + i, 10 + i)
                assert_right(x, transform(client, x))
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(120) == 0


def test_a_start_without_the_memory_for_its_slots_stops_at_once_in_one_line() -> None:
    port, grpc_port = free_ports(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFN_")} | LAYOUT
    env |= {"FFN_PORT": str(port), "FFN_GRPC_PORT": str(grpc_port), "FFN_HANDOFF_SLOTS": str(1 << 20)}  # 1 TiB a front
    done = subprocess.run(
        [sys.executable, "-m", "app.cli"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()  # a refused start: one `ffn-serve: ...` line, nothing started
    assert line.startswith("ffn-serve: "), line
    assert "no room for the hand-off's slots (2 fronts x 1 engine process x 1,048,576 slots of 1 MiB)" in line
    assert "2,097,184 MiB of shared memory" in line and "--memory" in line and "FFN_HANDOFF_SLOTS" in line
    assert "hung" not in done.stderr and "started (pid" not in done.stderr  # nothing started, nothing waited for
