"""System shared memory: regions registered, bounds-checked, read and written, released; in every worker.

Units: SharedMemoryRegions on objects this test makes in a folder of its own (links, FIFOs, sizes,
a copy on read, a short read after the client shrinks the object, nothing written outside the
region). In-process: the routes and infer parameters, every mistake a 4xx that names it, answers
checked against the float64 reference, descriptors released on unregister and at shutdown. A real
two-worker server: a region registered through one connection serves from every worker, and from
a worker killed and replaced; unregistered, from none. The tritonclient side is in
tests/test_tritonclient.py.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from app.config.settings import Settings
from app.protocol.errors import InvalidInput, RegionNotFound
from app.protocol.shared_memory import SHM_FOLDER, SharedMemoryRegions
from ffn_testing import ServerProcess, start_server
from tests.reference import demo_reference
from tests.worker_logs import pids_that_served, replaced, worker_pids

D = 512
ROW_BYTES = D * 4


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, D)).astype(np.float32)


class ShmObject:
    """A POSIX shared-memory object made by the test (as a client would), removed afterwards."""

    def __init__(self, size: int, folder: Path = SHM_FOLDER) -> None:
        self.name = f"ffn-test-{uuid.uuid4().hex[:12]}"
        self.key = "/" + self.name
        self.path = folder / self.name
        with open(self.path, "wb") as f:
            f.truncate(size)

    def write(self, offset: int, data: bytes) -> None:
        with open(self.path, "r+b") as f:
            f.seek(offset)
            f.write(data)

    def read(self, offset: int = 0, size: int | None = None) -> bytes:
        data = self.path.read_bytes()
        return data[offset:] if size is None else data[offset : offset + size]

    def descriptors_open_here(self) -> int:
        """How many of this process's file descriptors point at the object."""
        found = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                found += os.readlink(f"/proc/self/fd/{fd}") == str(self.path)
            except OSError:
                continue
        return found

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


@pytest.fixture
def objects() -> Iterator[list[ShmObject]]:
    made: list[ShmObject] = []
    yield made
    for obj in made:
        obj.remove()


def make(objects: list[ShmObject], size: int, folder: Path = SHM_FOLDER) -> ShmObject:
    obj = ShmObject(size, folder)
    objects.append(obj)
    return obj


# ----- the regions, unit by unit ----------------------------------------------------------------


def test_register_checks_the_key_the_object_and_the_bounds(tmp_path: Path, objects) -> None:
    regions = SharedMemoryRegions(folder=tmp_path, max_regions=2)
    obj = make(objects, 4096, tmp_path)
    (tmp_path / "link").symlink_to(obj.path)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    refused = {
        ("r", "../etc/passwd", 0, 8): "must be one name",
        ("r", "a/b", 0, 8): "must be one name",
        ("r", "..", 0, 8): "must be one name",
        ("r", "", 0, 8): "must be one name",
        ("r", "/nothing-here", 0, 8): "no shared memory object",
        ("r", "/link", 0, 8): "cannot open",  # a link is never followed
        ("r", "/fifo", 0, 8): "not a regular file",
        ("r", "/dir", 0, 8): "cannot open",
        ("r", obj.key, 0, 4097): "does not fit",
        ("r", obj.key, 4000, 97): "does not fit",
        ("r", obj.key, 0, 0): "byte_size >= 1",
        ("bad name", obj.key, 0, 8): "region name",
        ("-r", obj.key, 0, 8): "region name",
    }
    for (name, key, offset, size), message in refused.items():
        with pytest.raises(InvalidInput, match=message):
            regions.register(name, key, offset, size)
    assert regions.status() == []
    regions.register("a", obj.key, 4000, 96)  # the last 96 bytes: fits exactly
    regions.register("b", obj.name, 0, 8)  # the key's slash is optional, as for shm_open
    with pytest.raises(InvalidInput, match="already registered"):
        regions.register("a", obj.key, 0, 8)
    with pytest.raises(InvalidInput, match="2 shared memory regions are registered"):
        regions.register("c", obj.key, 0, 8)
    assert regions.status("a") == [{"name": "a", "key": obj.key, "offset": 4000, "byte_size": 96}]
    with pytest.raises(RegionNotFound):
        regions.status("c")
    regions.close_all()


def test_reads_copy_and_writes_stay_inside_the_region(tmp_path: Path, objects) -> None:
    regions = SharedMemoryRegions(folder=tmp_path)
    obj = make(objects, 256, tmp_path)
    obj.write(0, bytes(range(256)))
    region = regions.register("r", obj.key, 64, 128)  # bytes 64..191 of the object
    data = region.read(8, 16, "input")
    assert bytes(data) == bytes(range(72, 88))
    obj.write(72, b"\xff" * 16)  # the client changes the object: the copy does not change
    assert bytes(data) == bytes(range(72, 88))
    for offset, size in ((120, 16), (-1, 4), (0, 129), (128, 1)):
        with pytest.raises(InvalidInput, match="do not fit"):
            region.read(offset, size, "input")
    region.write(120, memoryview(b"\xaa" * 8), "output")  # the region's last 8 bytes
    with pytest.raises(InvalidInput, match="do not fit"):
        region.write(121, memoryview(b"\xbb" * 8), "output")
    after = obj.read()
    assert after[184:192] == b"\xaa" * 8
    assert after[:184] == bytes(range(72)) + b"\xff" * 16 + bytes(range(88, 184))
    assert after[192:] == bytes(range(192, 256))  # nothing past the region written


def test_a_shrunk_object_is_a_short_read_not_a_crash(tmp_path: Path, objects) -> None:
    regions = SharedMemoryRegions(folder=tmp_path)
    obj = make(objects, 4096, tmp_path)
    region = regions.register("r", obj.key, 0, 4096)
    os.truncate(obj.path, 100)  # a mapping would fault (SIGBUS) here
    with pytest.raises(InvalidInput, match="ends after 100 of 4096 bytes"):
        region.read(0, 4096, "input")


def test_unregister_closes_the_descriptor(tmp_path: Path, objects) -> None:
    regions = SharedMemoryRegions(folder=tmp_path)
    obj = make(objects, 64, tmp_path)
    region = regions.register("r", obj.key, 0, 64, registration="first")
    assert obj.descriptors_open_here() == 1
    assert regions.unregister("r", registration="another") is False  # an undo of another registration
    assert obj.descriptors_open_here() == 1
    assert regions.unregister("r") is True and regions.unregister("r") is False
    assert obj.descriptors_open_here() == 0
    with pytest.raises(InvalidInput, match="was unregistered while the request ran"):
        region.write(0, memoryview(b"x"), "output")


# ----- the routes and infer, in-process ---------------------------------------------------------


def register_body(obj: ShmObject, byte_size: int, offset: int = 0) -> dict:
    return {"key": obj.key, "offset": offset, "byte_size": byte_size}


def shm_input(region: str, n: int, offset: int = 0, byte_size: int | None = None) -> dict:
    parameters = {"shared_memory_region": region, "shared_memory_byte_size": byte_size or n * ROW_BYTES}
    if offset:
        parameters["shared_memory_offset"] = offset
    return {"name": "input", "shape": [n, D], "datatype": "FP32", "parameters": parameters}


def shm_output(region: str, byte_size: int, offset: int = 0, **more: object) -> dict:
    parameters = {"shared_memory_region": region, "shared_memory_byte_size": byte_size, **more}
    if offset:
        parameters["shared_memory_offset"] = offset
    return {"name": "output", "parameters": parameters}


async def test_off_by_default_every_use_names_the_extension_and_the_setting(start_app) -> None:
    client = (await start_app(Settings(warmup=False))).client
    assert "system_shared_memory" not in (await client.get("/v2")).json()["extensions"]
    answers = [
        await client.get("/v2/systemsharedmemory/status"),
        await client.get("/v2/systemsharedmemory/region/r/status"),
        await client.post("/v2/systemsharedmemory/region/r/register", json={"key": "/k", "byte_size": 8}),
        await client.post("/v2/systemsharedmemory/region/r/unregister"),
        await client.post("/v2/systemsharedmemory/unregister"),
        await client.post("/v2/models/demo/infer", json={"inputs": [shm_input("r", 1)]}),
    ]
    for r in answers:
        assert (r.status_code, r.json()["error_type"]) == (400, "unsupported_extension")
        assert "system_shared_memory" in r.json()["error"] and "shared_memory = true" in r.json()["error"]


async def test_cuda_shared_memory_says_why_it_is_refused(start_app) -> None:
    client = (await start_app(Settings(warmup=False, shared_memory=True))).client
    r = await client.post("/v2/cudasharedmemory/region/r/register", json={"raw_handle": {"b64": "eA=="}})
    assert (r.status_code, r.json()["error_type"]) == (400, "unsupported_extension")
    assert "cuda_shared_memory" in r.json()["error"] and "use system shared memory" in r.json()["error"]


async def test_inputs_and_outputs_through_shared_memory(start_app, objects) -> None:
    served = await start_app(Settings(warmup=False, shared_memory=True))
    client = served.client
    assert "system_shared_memory" in (await client.get("/v2")).json()["extensions"]
    x = rows(6, 1)
    source = make(objects, 64 + x.nbytes)
    source.write(64, x.tobytes())  # the tensor at offset 64 of the object
    target = make(objects, 3 * x.nbytes)
    target.write(0, b"\x5a" * 3 * x.nbytes)  # a pattern that must survive around the output
    for name, obj, size in (("in", source, x.nbytes), ("out", target, 2 * x.nbytes)):
        offset = 64 if name == "in" else x.nbytes  # "out" is the middle two thirds of the object
        r = await client.post(f"/v2/systemsharedmemory/region/{name}/register", json=register_body(obj, size, offset))
        assert r.status_code == 200, r.text
    status = (await client.get("/v2/systemsharedmemory/status")).json()
    assert status == [
        {"name": "in", "key": source.key, "offset": 64, "byte_size": x.nbytes},
        {"name": "out", "key": target.key, "offset": x.nbytes, "byte_size": 2 * x.nbytes},
    ]
    assert (await client.get("/v2/systemsharedmemory/region/out/status")).json() == status[1:]

    # Both ways through shared memory: the answer has no data, the output is in the region.
    body = {"id": "s1", "inputs": [shm_input("in", 6)], "outputs": [shm_output("out", x.nbytes, offset=16)]}
    r = await client.post("/v2/models/demo/infer", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [6, D]}]
    written = np.frombuffer(target.read(x.nbytes + 16, x.nbytes), dtype=np.float32).reshape(6, D)
    np.testing.assert_allclose(written.astype(np.float64), demo_reference(x), rtol=1e-5, atol=1e-5)
    untouched = target.read()
    assert untouched[: x.nbytes + 16] == b"\x5a" * (x.nbytes + 16)  # before the output
    assert untouched[2 * x.nbytes + 16 :] == b"\x5a" * (x.nbytes - 16)  # after it

    # Input from the region, output in the body (binary), and a part of the input region.
    r = await client.post(
        "/v2/models/demo/infer",
        json={
            "inputs": [shm_input("in", 2, offset=2 * ROW_BYTES)],
            "outputs": [{"name": "output", "parameters": {"binary_data": False}}],
        },
    )
    assert r.status_code == 200, r.text
    y = np.asarray(r.json()["outputs"][0]["data"], dtype=np.float64).reshape(2, D)
    np.testing.assert_allclose(y, demo_reference(x[2:4]), rtol=1e-5, atol=1e-5)

    state = served.app.state.service
    for name in ("in", "out"):
        assert state.shared_memory.get(name).fd is not None
    assert source.descriptors_open_here() == 1
    assert (await client.post("/v2/systemsharedmemory/region/in/unregister")).status_code == 200
    assert source.descriptors_open_here() == 0  # released on unregister
    assert (await client.post("/v2/systemsharedmemory/region/in/unregister")).status_code == 200  # as Triton
    assert [s["name"] for s in (await client.get("/v2/systemsharedmemory/status")).json()] == ["out"]
    assert (await client.post("/v2/systemsharedmemory/unregister")).status_code == 200
    assert (await client.get("/v2/systemsharedmemory/status")).json() == []
    assert target.descriptors_open_here() == 0


async def test_regions_are_released_at_shutdown(start_app, objects) -> None:
    from tests.in_process import serve_in_process

    obj = make(objects, 1024)
    async with serve_in_process(Settings(warmup=False, shared_memory=True)) as served:
        r = await served.client.post("/v2/systemsharedmemory/region/r/register", json=register_body(obj, 1024))
        assert r.status_code == 200 and obj.descriptors_open_here() == 1
    assert obj.descriptors_open_here() == 0


@pytest.mark.parametrize(
    ("request_body", "status", "error_type", "message"),
    [
        ({"inputs": [shm_input("nope", 1)]}, 404, "region_not_found", "no system shared memory region named 'nope'"),
        ({"inputs": [shm_input("in", 1, offset=4 * ROW_BYTES)]}, 400, "invalid_input", "do not fit"),
        ({"inputs": [shm_input("in", 2, byte_size=ROW_BYTES)]}, 400, "invalid_input", "needs 4096"),
        (
            {"inputs": [{**shm_input("in", 1), "data": [0.0] * D}]},
            400,
            "invalid_input",
            "only one of 'data', 'binary_data_size' and 'shared_memory_region'",
        ),
        (
            {"inputs": [{**shm_input("in", 1), "parameters": {"shared_memory_region": "in"}}]},
            400,
            "invalid_input",
            "go together",
        ),
        (
            {"inputs": [shm_input("in", 1)], "outputs": [shm_output("out", ROW_BYTES - 1)]},
            400,
            "invalid_input",
            "the output needs 2048",
        ),
        (
            {"inputs": [shm_input("in", 1)], "outputs": [shm_output("out", ROW_BYTES, binary_data=True)]},
            400,
            "invalid_input",
            "both shared_memory_region and binary_data",
        ),
        (
            {"inputs": [shm_input("in", 1)], "outputs": [shm_output("out", ROW_BYTES, offset=4 * ROW_BYTES)]},
            400,
            "invalid_input",
            "do not fit",
        ),
        (
            {"inputs": [{**shm_input("in", 1), "parameters": {"shared_memory_region": 5}}]},
            400,
            "invalid_input",
            "must be a string",
        ),
        ({"inputs": [shm_input("big", 200)]}, 413, "payload_too_large", "exceeds what a request may hold"),
    ],
)
async def test_a_bad_shared_memory_request_is_refused_and_the_next_one_served(
    start_app, objects, request_body, status, error_type, message
) -> None:
    # A body limit of 256 KiB: a 200-row input (400 KiB) in a region is over it, as a body would be.
    client = (await start_app(Settings(warmup=False, shared_memory=True, max_body_bytes=256 * 1024))).client
    x = rows(4, 2)
    obj = make(objects, 400 * 1024)
    obj.write(0, x.tobytes())
    for name, size in (("in", x.nbytes), ("out", x.nbytes), ("big", 400 * 1024)):
        r = await client.post(f"/v2/systemsharedmemory/region/{name}/register", json=register_body(obj, size))
        assert r.status_code == 200, r.text
    r = await client.post("/v2/models/demo/infer", json=request_body)
    assert (r.status_code, r.json()["error_type"]) == (status, error_type), r.text
    assert message in r.json()["error"]
    r = await client.post("/v2/models/demo/infer", json={"inputs": [shm_input("in", 4)]})  # served right after
    assert r.status_code == 200
    y = np.asarray(r.json()["outputs"][0]["data"], dtype=np.float64).reshape(4, D)
    np.testing.assert_allclose(y, demo_reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"key": "/x", "byte_size": 8, "extra": 1}, "unknown register field 'extra'"),
        ({"byte_size": 8}, "needs 'key' and 'byte_size'"),
        ({"key": "/x"}, "needs 'key' and 'byte_size'"),
        ({"key": "/x", "byte_size": "8"}, "'byte_size' must be an integer"),
        ({"key": "/x", "byte_size": 8, "offset": -1}, "'offset' must be an integer in [0,"),
        ({"key": "/../../etc/passwd", "byte_size": 8}, "must be one name"),
        ({"key": "/ffn-test-no-such-object", "byte_size": 8}, "no shared memory object"),
        ([1], "must be a JSON object"),
    ],
)
async def test_a_bad_registration_is_400_and_registers_nothing(start_app, body, message) -> None:
    client = (await start_app(Settings(warmup=False, shared_memory=True))).client
    r = await client.post("/v2/systemsharedmemory/region/r/register", json=body)
    assert (r.status_code, r.json()["error_type"]) == (400, "invalid_input"), r.text
    assert message in r.json()["error"]
    assert (await client.get("/v2/systemsharedmemory/status")).json() == []


async def test_a_region_name_outside_the_pattern_is_refused(start_app, objects) -> None:
    client = (await start_app(Settings(warmup=False, shared_memory=True))).client
    obj = make(objects, 64)
    r = await client.post("/v2/systemsharedmemory/region/a%20b/register", json=register_body(obj, 64))
    assert r.status_code == 400 and "region name 'a b'" in r.json()["error"]
    r = await client.get("/v2/systemsharedmemory/region/unknown/status")
    assert (r.status_code, r.json()["error_type"]) == (404, "region_not_found")


async def test_a_shrunk_object_answers_400_and_the_server_goes_on(start_app, objects) -> None:
    client = (await start_app(Settings(warmup=False, shared_memory=True))).client
    obj = make(objects, 4 * ROW_BYTES)
    assert (
        await client.post("/v2/systemsharedmemory/region/r/register", json=register_body(obj, 4 * ROW_BYTES))
    ).status_code == 200
    os.truncate(obj.path, ROW_BYTES)
    r = await client.post("/v2/models/demo/infer", json={"inputs": [shm_input("r", 4)]})
    assert r.status_code == 400 and "was made smaller after it was registered" in r.json()["error"]
    assert (await client.get("/v2/health/ready")).status_code == 200


# ----- every worker -------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["copies", "shared engine"])
def two_workers(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """Two workers with their own models, or two fronts of one engine process (shared_engine): the
    regions are the workers' (the fronts read the requests) either way."""
    env = {
        "FFN_WORKERS": "2",
        "FFN_SHARED_MEMORY": "true",
        "FFN_LOG_FORMAT": "json",
        "FFN_ACCESS_LOG": "true",
        "FFN_TORCH_THREADS": "1",
        "FFN_SHARED_ENGINE": str(request.param == "shared engine").lower(),
    }
    with start_server(env=env, ready_timeout=180) as server:
        yield server


def infer_from_every_worker(server: ServerProcess, workers: set[int], body: dict, expected: int) -> None:
    """Send `body` on new connections until each of `workers` (pids) has answered it; every status `expected`."""
    since = len(server.logs())
    path = "/v2/models/demo/infer"
    for _ in range(400):
        r = httpx.post(server.url + path, json=body, headers={"Connection": "close"})
        assert r.status_code == expected, r.text
        if workers <= pids_that_served(server, path, since):
            return
    pytest.fail(f"workers {workers} did not all answer; served by {pids_that_served(server, path, since)}")


@pytest.mark.server
def test_every_worker_and_a_replacement_hold_the_regions(two_workers: ServerProcess, objects) -> None:
    server = two_workers
    pids = worker_pids(server)
    x = rows(3, 3)
    source, target = make(objects, x.nbytes), make(objects, x.nbytes)
    source.write(0, x.tobytes())
    for name, obj in (("in", source), ("out", target)):
        r = httpx.post(f"{server.url}/v2/systemsharedmemory/region/{name}/register", json=register_body(obj, x.nbytes))
        assert r.status_code == 200, r.text
    body = {"inputs": [shm_input("in", 3)], "outputs": [shm_output("out", x.nbytes)]}
    infer_from_every_worker(server, set(pids.values()), body, 200)
    written = np.frombuffer(target.read(), dtype=np.float32).reshape(3, D)
    np.testing.assert_allclose(written.astype(np.float64), demo_reference(x), rtol=1e-5, atol=1e-5)

    since = len(server.logs())
    os.kill(pids[2], signal.SIGKILL)
    replacement = replaced(server, 2, pids[2], since)  # the registrations are replayed to it first
    infer_from_every_worker(server, {pids[1], replacement}, body, 200)

    assert httpx.post(f"{server.url}/v2/systemsharedmemory/region/in/unregister").status_code == 200
    infer_from_every_worker(server, {pids[1], replacement}, body, 404)  # gone from every worker
    assert httpx.post(f"{server.url}/v2/systemsharedmemory/unregister").status_code == 200
    for pid in (pids[1], replacement):  # every worker closed its descriptors
        links = open_files(pid)
        assert str(source.path) not in links and str(target.path) not in links


def open_files(pid: int) -> list[str]:
    """What the process's descriptors name now (one it closes while they are read is not among them)."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:  # closed between the listing and the read: a socket of a finished request
            pass
    return links
