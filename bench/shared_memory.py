"""System shared memory against the socket, in one run: V2 binary requests of 256 rows, rows/s and p50.

    python3 -m bench.shared_memory                                  # C 1 and 8, 5 s per timing, 3 repeats
    python3 -m bench.shared_memory --concurrency 4 --seconds 2 --repeats 3

One server (system shared memory on, pinned to core 0, one torch thread) serves two models: the
real one (the built-in demo, d_model 512, d_ff 2048) and a near-free one (d_model 512, d_ff 8),
where moving the tensors is most of the cost. A closed loop of C keep-alive connections (pinned
to core 1) sends requests two ways, each time delivering a fresh input and getting the output
as a numpy array:

- socket: the V2 binary extension, the input's 512 KiB in the body and the output's in the answer;
- shared memory: each connection's input and output regions registered once; the client copies
  the input into its region, the request names both regions, and the answer carries no tensor.

Timings alternate between the two ways (so a busy machine slows both alike); the median of the
repeats is reported, and shared memory's rows/s as a ratio of the socket's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path

import httpx
import numpy as np
import orjson
import torch

from bench.serve import pinned
from ffn_client.http1 import build_request, read_response
from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_testing import HOST, start_server

D_MODEL = 512
MODELS = {"real": "demo (d_ff 2048)", "tiny": "near-free (d_ff 8)"}


@dataclass
class Timing:
    rows_per_s: float
    p50_ms: float


class Connection:
    """One keep-alive connection and, for shared memory, its two registered regions."""

    def __init__(self, index: int, rows: int, model: str) -> None:
        self.index, self.rows, self.model = index, rows, model
        self.x = np.random.default_rng(index).standard_normal((rows, D_MODEL)).astype(np.float32)
        self.nbytes = self.x.nbytes
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.regions: dict[str, shared_memory.SharedMemory] = {}

    async def open(self, port: int) -> None:
        self.reader, self.writer = await asyncio.open_connection(HOST, port)

    def make_regions(self, url: str, tag: str) -> None:
        for kind in ("in", "out"):
            name = f"bench-{tag}-{kind}-{self.index}"
            region = shared_memory.SharedMemory(name=name, create=True, size=self.nbytes)
            self.regions[kind] = region
            body = {"key": "/" + name, "byte_size": self.nbytes}
            r = httpx.post(f"{url}/v2/systemsharedmemory/region/{name}/register", json=body)
            r.raise_for_status()

    def socket_header(self) -> bytes:
        header = orjson.dumps(
            {
                "inputs": [
                    {
                        "name": "input",
                        "shape": [self.rows, D_MODEL],
                        "datatype": "FP32",
                        "parameters": {"binary_data_size": self.nbytes},
                    }
                ],
                "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
            }
        )
        return header

    def shm_request(self) -> bytes:
        names = {kind: region.name for kind, region in self.regions.items()}
        body = orjson.dumps(
            {
                "inputs": [
                    {
                        "name": "input",
                        "shape": [self.rows, D_MODEL],
                        "datatype": "FP32",
                        "parameters": {"shared_memory_region": names["in"], "shared_memory_byte_size": self.nbytes},
                    }
                ],
                "outputs": [
                    {
                        "name": "output",
                        "parameters": {"shared_memory_region": names["out"], "shared_memory_byte_size": self.nbytes},
                    }
                ],
            }
        )
        return build_request(
            "POST", f"/v2/models/{self.model}/infer", {"Content-Type": "application/json"}, body, host=HOST
        )

    async def one_socket(self, header: bytes) -> np.ndarray:
        body = b"".join([header, memoryview(self.x).cast("B")])  # the input, copied into the request
        path = f"/v2/models/{self.model}/infer"
        headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}
        assert self.writer is not None and self.reader is not None
        self.writer.write(build_request("POST", path, headers, body, host=HOST))
        response = await read_response(self.reader)
        assert response.status == 200, response.body[:300]
        start = int(response.headers["inference-header-content-length"])
        return np.frombuffer(response.body, dtype=np.float32, offset=start).reshape(self.rows, D_MODEL)

    async def one_shm(self, request: bytes) -> np.ndarray:
        np.copyto(np.ndarray(self.x.shape, np.float32, buffer=self.regions["in"].buf), self.x)  # the input, copied in
        assert self.writer is not None and self.reader is not None
        self.writer.write(request)
        response = await read_response(self.reader)
        assert response.status == 200, response.body[:300]
        return np.ndarray((self.rows, D_MODEL), np.float32, buffer=self.regions["out"].buf)

    def close(self, url: str) -> None:
        if self.writer is not None:
            self.writer.close()
        for region in self.regions.values():
            httpx.post(f"{url}/v2/systemsharedmemory/region/{region.name}/unregister")
            region.close()
            region.unlink()


async def closed_loop(connections: list[Connection], way: str, seconds: float) -> Timing:
    latencies: list[float] = []
    stop = time.perf_counter() + seconds

    async def run(connection: Connection) -> None:
        request = connection.shm_request() if way == "shm" else connection.socket_header()
        while time.perf_counter() < stop:
            started = time.perf_counter()
            if way == "shm":
                await connection.one_shm(request)
            else:
                await connection.one_socket(request)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(run(c) for c in connections))
    elapsed = time.perf_counter() - started
    return Timing(len(latencies) * connections[0].rows / elapsed, statistics.median(latencies) * 1000)


async def measure(
    url: str, port: int, model: str, concurrency: int, args: argparse.Namespace
) -> dict[str, list[Timing]]:
    connections = [Connection(i, args.rows, model) for i in range(concurrency)]
    tag = f"{os.getpid()}-{model}-{concurrency}"
    try:
        for connection in connections:
            await connection.open(port)
            connection.make_regions(url, tag)
        results: dict[str, list[Timing]] = {"socket": [], "shm": []}
        for way in ("socket", "shm"):
            await closed_loop(connections, way, args.warmup)
        for _ in range(args.repeats):
            for way in ("socket", "shm"):
                results[way].append(await closed_loop(connections, way, args.seconds))
        # The shared-memory answers are the FFN's: checked once against the socket's.
        check = connections[0]
        via_socket = await check.one_socket(check.socket_header())
        via_shm = await check.one_shm(check.shm_request())
        np.testing.assert_allclose(via_shm, via_socket, rtol=1e-5, atol=1e-5)  # float tolerance: batches differ
        return results
    finally:
        for connection in connections:
            connection.close(url)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256, help="rows per request")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--seconds", type=float, default=5.0, help="per timing")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of each way before the timings")
    p.add_argument("--repeats", type=int, default=3, help="timings per way and cell; the median is reported")
    p.add_argument("--server-cpus", default="0")
    p.add_argument("--client-cpus", default="1")
    args = p.parse_args(argv)
    if args.client_cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})
    torch.manual_seed(0)
    rows_out = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_ffn(build_ffn(FFNConfig(d_model=D_MODEL, d_ff=8)).requires_grad_(False), folder / "tiny.safetensors")
        (folder / "bench.toml").write_text(
            '[[models]]\nname = "real"\n\n[[models]]\nname = "tiny"\nweights = "tiny.safetensors"\n'
        )
        env = {
            "FFN_SHARED_MEMORY": "true",
            "FFN_TORCH_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "FFN_LOG_LEVEL": "warning",
        }
        with start_server(env, folder / "bench.toml", prefix=pinned(args.server_cpus), ready_timeout=120) as server:
            for model in MODELS:
                for concurrency in args.concurrency:
                    results = asyncio.run(measure(server.url, server.port, model, concurrency, args))
                    socket = Timing(
                        statistics.median(t.rows_per_s for t in results["socket"]),
                        statistics.median(t.p50_ms for t in results["socket"]),
                    )
                    shm = Timing(
                        statistics.median(t.rows_per_s for t in results["shm"]),
                        statistics.median(t.p50_ms for t in results["shm"]),
                    )
                    row = (
                        f"| {MODELS[model]} | {concurrency} | {socket.rows_per_s:,.0f} | {socket.p50_ms:.2f} "
                        f"| {shm.rows_per_s:,.0f} | {shm.p50_ms:.2f} | {shm.rows_per_s / socket.rows_per_s:.2f}x |"
                    )
                    rows_out.append(row)
                    print(row, flush=True)
    print()
    print(
        f"V2 binary, {args.rows} rows of {D_MODEL} float32 a request (512 KiB each way); server on cores "
        f"{args.server_cpus} (1 torch thread), client on {args.client_cpus}; median of {args.repeats} timings "
        f"of {args.seconds:g} s per way"
    )
    print()
    print("| model | C | socket rows/s | socket p50 ms | shared memory rows/s | shared memory p50 ms | rows/s ratio |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
