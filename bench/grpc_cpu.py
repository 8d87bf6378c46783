"""Server CPU time per gRPC ModelInfer call, and the same for another checkout in the same run (an A/B).

    python3 -m bench.grpc_cpu                                     # this checkout
    git worktree add /tmp/before <commit>
    python3 -m bench.grpc_cpu --against /tmp/before --repeat 4    # alternating rounds, old and new
    python3 -m bench.grpc_cpu --tls --repeat 4                     # and this checkout over TLS (this+tls)
    python3 -m bench.grpc_cpu --floor --repeat 3                   # and a bare grpc.aio echo servicer (echo)
    python3 -m bench.grpc_cpu --floor --near-free --repeat 3       # the model near-free (512/8): the door's own cost

The gRPC twin of bench/cpu.py: the server pinned to core 0 with one torch thread (the built-in
demo model), this process sending prebuilt ModelInferRequests (raw_input_contents, one row, as
tritonclient.grpc sends them) over one channel from `--clients` concurrent callers, `--calls`
calls per cell after 200 to warm up. The figure is the server's own CPU time per call (utime +
stime from /proc over the measured calls): on a shared machine it moves far less than latency.
Each round measures every checkout once; the table gives each cell's median and least. With
`--floor`, a bare grpc.aio servicer that echoes the request (bench/grpc_echo.py) is measured in the
same rounds, and each cell's CPU per call is also given as a multiple of the echo's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import torch
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from bench.gpu.service import BenchTls, tree_cpu_seconds
from bench.serve import pinned, server_env
from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_testing import HOST, ServerProcess, free_port, start_server

REPO_ROOT = Path(__file__).resolve().parent.parent
D_MODEL = 512  # the demo model's


async def _measure(
    server: ServerProcess, calls: int, clients: int, rows: int, tls: BenchTls | None = None
) -> tuple[float, float, float]:
    """(server CPU µs per call, p50 ms, calls/s) over `calls` calls from `clients` concurrent callers; over
    TLS on one channel (one handshake) when `tls` is given."""
    x = np.random.default_rng(0).standard_normal((rows, D_MODEL)).astype(np.float32)
    request = pb.ModelInferRequest(model_name="demo", raw_input_contents=[x.tobytes()])
    request.inputs.add(name="input", datatype="FP32", shape=[rows, D_MODEL])
    latencies: list[float] = []
    channel = (
        grpc.aio.secure_channel(server.grpc_target, grpc.ssl_channel_credentials(tls.ca.read_bytes()))
        if tls is not None
        else grpc.aio.insecure_channel(server.grpc_target)
    )
    async with channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(200):
            await stub.ModelInfer(request)

        async def caller(count: int) -> None:
            for _ in range(count):
                started = time.perf_counter()
                await stub.ModelInfer(request)
                latencies.append(time.perf_counter() - started)

        cpu_before, started = tree_cpu_seconds(server.proc.pid), time.perf_counter()
        await asyncio.gather(*(caller(calls // clients) for _ in range(clients)))
        elapsed, cpu = time.perf_counter() - started, tree_cpu_seconds(server.proc.pid) - cpu_before
    done = (calls // clients) * clients
    return cpu / done * 1e6, statistics.median(latencies) * 1e3, done / elapsed


@dataclass
class Echo:
    """The bare servicer's process, as _measure reads a server: its pid and gRPC target."""

    proc: subprocess.Popen[bytes]
    grpc_target: str


def measure_echo(calls: int, clients: int, rows: int) -> tuple[float, float, float]:
    """The same cell against bench/grpc_echo.py, pinned to the server core."""
    port = free_port()
    command = [*pinned(0), sys.executable, "-m", "bench.grpc_echo", "--port", str(port)]
    proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        echo = Echo(proc, f"{HOST}:{port}")

        async def when_up() -> tuple[float, float, float]:
            async with grpc.aio.insecure_channel(echo.grpc_target) as channel:
                await asyncio.wait_for(channel.channel_ready(), 60)
            return await _measure(echo, calls, clients, rows)  # type: ignore[arg-type]

        return asyncio.run(when_up())
    finally:
        proc.terminate()
        proc.wait(30)


def near_free_config(folder: Path) -> Path:
    """A config serving a near-free model (d_model 512, d_ff 8, GELU) as `demo`: what is left is the door's cost."""
    torch.manual_seed(0)
    save_ffn(build_ffn(FFNConfig(d_model=D_MODEL, d_ff=8, activation="gelu")), folder / "near-free.safetensors")
    config = folder / "near-free.toml"
    config.write_text('[[models]]\nname = "demo"\nweights = "near-free.safetensors"\n')
    return config


def measure(
    checkout: Path, calls: int, clients: int, rows: int, tls: BenchTls | None = None, config: Path | None = None
) -> tuple[float, float, float]:
    env = {**server_env(max_wait_ms=0, max_batch_rows=1024), "FFN_WARMUP": "1", **(tls.env() if tls else {})}
    verify = None if tls is None else tls.ca
    with start_server(env=env, config=config, cwd=checkout, prefix=pinned(0), verify=verify) as server:
        return asyncio.run(_measure(server, calls, clients, rows, tls))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, help="another checkout to measure in the same run")
    parser.add_argument("--repeat", type=int, default=1, help="rounds; each round measures every checkout once")
    parser.add_argument("--calls", type=int, default=3000, help="measured calls per cell")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16], help="concurrent callers, one cell each")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--tls", action="store_true", help="also this checkout over TLS (this+tls), in each round")
    parser.add_argument("--floor", action="store_true", help="also a bare grpc.aio echo servicer (echo), in each round")
    parser.add_argument("--near-free", action="store_true", help="serve a near-free model (512/8) instead of the demo")
    args = parser.parse_args(argv)
    checkouts = {"this": REPO_ROOT, **({"other": args.against.resolve()} if args.against else {})}
    if args.floor:
        checkouts["echo"] = REPO_ROOT
    if args.tls:
        checkouts["this+tls"] = REPO_ROOT
    found: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as folder:
        tls = BenchTls.made_in(Path(folder)) if args.tls else None
        config = near_free_config(Path(folder)) if args.near_free else None
        for round_ in range(args.repeat):
            for name, checkout in checkouts.items():
                for clients in args.clients:
                    if name == "echo":
                        cell = measure_echo(args.calls, clients, args.rows)
                    else:
                        cell = measure(
                            checkout, args.calls, clients, args.rows, tls if name.endswith("+tls") else None, config
                        )
                    found.setdefault((name, clients), []).append(cell)
                    print(
                        f"round {round_ + 1}: {name} C={clients}: {cell[0]:,.0f} us/call, p50 {cell[1]:.2f} ms",
                        flush=True,
                    )
    print()
    print("| checkout | C | server CPU µs/call, median | least | × echo | p50 ms | calls/s |")
    print("|---|---|---|---|---|---|---|")
    for (name, clients), cells in found.items():
        cpu = [cell[0] for cell in cells]
        p50 = statistics.median(cell[1] for cell in cells)
        rate = statistics.median(cell[2] for cell in cells)
        floor = found.get(("echo", clients))
        times = "-" if floor is None else f"{statistics.median(cpu) / statistics.median(c[0] for c in floor):.1f}"
        print(
            f"| {name} | {clients} | {statistics.median(cpu):,.0f} | {min(cpu):,.0f} | {times} | {p50:.2f} | {rate:,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
