"""The service against the in-process model, in one run: rows/s and latency over HTTP.

    python3 -m bench.serve                       # 768/3072 GELU float32, r in {1,16}, C in {1,16,64}
    python3 -m bench.serve --max-wait-ms 0 1 2 --seconds 5 --json out/serve.json --plot docs/img/serve.png
    python3 -m bench.serve --workers 1 2 --server-cpus 0,1 --client-cpus 0,1    # 1 and 2 worker processes
    python3 -m bench.serve --server-dirs . /tmp/before --repeats 3    # this checkout against another, cell by cell

The server runs pinned to core 0 with one torch thread per worker; the load generator (wrk,
closed loop with C connections) runs pinned to core 1; the in-process rows/s is measured pinned
to core 0 with one thread at the batch size the batcher actually formed (mean rows per batch,
read from /metrics), so every ratio compares like with like (with several workers on several
cores, the ratio is against that one core and may pass 100 %). Needs `wrk` (Debian package wrk)
and Linux. With several `--server-dirs` (checkouts whose app/ is served), each cell runs against
each in turn, `--repeats` times, and the table ends with each checkout's median req/s and p99
as a ratio of the first's: the cost of a change on the request path, measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np
import torch

from bench.micro import measure_rows_per_s
from ffn_client.encodings import encode_request
from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_testing import metric_value, start_server

LUA = Path(__file__).with_name("wrk") / "post.lua"
SERVER_CORE = 0  # the in-process reference runs here


REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Cell:
    server: str
    workers: int
    encoding: str
    rows_per_request: int
    concurrency: int
    max_wait_ms: float
    requests_per_s: float
    rows_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    errors: int
    mean_batch_rows: float
    inprocess_rows_per_s: float
    ratio: float


def pinned(cpus: int | str) -> list[str]:
    """A taskset prefix for a core or a list ("0,1"), or nothing where taskset is missing."""
    return ["taskset", "-c", str(cpus)] if shutil.which("taskset") else []


def server_env(max_wait_ms: float, max_batch_rows: int, workers: int = 1) -> dict[str, str]:
    """One torch thread (and one OpenMP thread) per worker, so that each stays on one core."""
    return {
        "FFN_TORCH_THREADS": "1",
        "FFN_MAX_WAIT_MS": str(max_wait_ms),
        "FFN_MAX_BATCH_ROWS": str(max_batch_rows),
        "FFN_WORKERS": str(workers),
        "FFN_LOG_LEVEL": "warning",
        "OMP_NUM_THREADS": "1",
    }


def batch_stats(url: str) -> tuple[float, float]:
    """(sum of rows, number of batches) of model `ffn` from ffn_batch_rows."""
    page = httpx.get(f"{url}/metrics").text
    return metric_value(page, "ffn_batch_rows_sum", model="ffn"), metric_value(
        page, "ffn_batch_rows_count", model="ffn"
    )


def request_body(encoding: str, rows: int, d_model: int, folder: Path) -> tuple[Path, str]:
    """A request body file for wrk's post.lua, and its headers joined with '|'."""
    x = np.random.default_rng(rows).standard_normal((rows, d_model)).astype(np.float32)
    request = encode_request("ffn", x, encoding)
    path = folder / f"body-{encoding}-{rows}"
    path.write_bytes(request.body)
    return path, "|".join(f"{name}: {value}" for name, value in request.headers.items())


def run_wrk(url: str, body: Path, headers: str, concurrency: int, seconds: float, cpus: str = "1") -> dict:
    env = os.environ | {"BENCH_BODY": str(body), "BENCH_HEADERS": headers}
    command = [
        *pinned(cpus),
        "wrk",
        "-t1",
        f"-c{concurrency}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "10s",
        "-s",
        str(LUA),
        url,
    ]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


class InProcess:
    """In-process rows/s of the same model, one thread on the server's core, cached by batch size.

    Best of `repeat` timings: on a shared (virtual) machine a single timing can be far below
    what the core does, and a low denominator would flatter the service.
    """

    def __init__(self, model, seconds: float, repeat: int = 3) -> None:
        self.model, self.seconds, self.repeat, self.cache = model, seconds, repeat, {}

    def rows_per_s(self, rows: int) -> float:
        rows = max(1, rows)
        if rows not in self.cache:
            previous = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {SERVER_CORE})
            try:
                self.cache[rows] = max(
                    measure_rows_per_s(self.model, rows, torch.float32, 1, self.seconds) for _ in range(self.repeat)
                )
            finally:
                os.sched_setaffinity(0, previous)
        return self.cache[rows]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--d-ff", type=int, default=3072)
    p.add_argument("--activation", default="gelu")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--encodings", nargs="+", default=["binary", "json"], choices=["binary", "json"])
    p.add_argument("--max-wait-ms", type=float, nargs="+", default=[0.0])
    p.add_argument("--max-batch-rows", type=int, default=1024)
    p.add_argument(
        "--workers", type=int, nargs="+", default=[1], help="worker processes (FFN_WORKERS), one server each"
    )
    p.add_argument("--server-cpus", default=str(SERVER_CORE), help="taskset list for the server, e.g. 0 or 0,1")
    p.add_argument("--client-cpus", default="1", help="taskset list for wrk")
    p.add_argument("--seconds", type=float, default=5.0, help="wrk duration per cell")
    p.add_argument(
        "--server-dirs", type=Path, nargs="+", default=[REPO_ROOT], help="checkouts whose app/ is served, compared"
    )
    p.add_argument("--repeats", type=int, default=1, help="runs of each cell against each checkout (interleaved)")
    p.add_argument("--json", type=Path, help="write the cells as JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG plot here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not shutil.which("wrk"):
        print("bench.serve needs wrk (apt-get install wrk)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    config = FFNConfig(d_model=args.d_model, d_ff=args.d_ff, activation=args.activation)
    model = build_ffn(config).requires_grad_(False)
    inprocess = InProcess(model, seconds=1.0)
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_ffn(model, folder / "ffn.safetensors")
        (folder / "ffn.toml").write_text('[[models]]\nname = "ffn"\nweights = "ffn.safetensors"\n')
        runs = [
            (server_dir, w, m)
            for _ in range(args.repeats)
            for w in args.workers
            for m in args.max_wait_ms
            for server_dir in args.server_dirs
        ]
        for server_dir, workers, max_wait in runs:
            with start_server(
                server_env(max_wait, args.max_batch_rows, workers),
                folder / "ffn.toml",
                prefix=pinned(args.server_cpus),
                cwd=server_dir,
                ready_timeout=120.0,
            ) as server:
                base = server.url
                url = f"{base}/v1/models/ffn/transform"
                for encoding in args.encodings:
                    for rows in args.rows:
                        body, headers = request_body(encoding, rows, args.d_model, folder)
                        for concurrency in args.concurrency:
                            run_wrk(url, body, headers, concurrency, 1, args.client_cpus)  # warm-up
                            before = batch_stats(base)
                            result = run_wrk(url, body, headers, concurrency, args.seconds, args.client_cpus)
                            after = batch_stats(base)
                            batches = after[1] - before[1]
                            mean_batch = (after[0] - before[0]) / batches if batches else float(rows)
                            seconds = result["duration_us"] / 1e6
                            ok = result["requests"] - result["status_errors"]
                            base_rps = inprocess.rows_per_s(round(mean_batch))
                            rows_per_s = ok * rows / seconds
                            cell = Cell(
                                server_dir.resolve().name,
                                workers,
                                encoding,
                                rows,
                                concurrency,
                                max_wait,
                                ok / seconds,
                                rows_per_s,
                                result["p50_us"] / 1000,
                                result["p90_us"] / 1000,
                                result["p99_us"] / 1000,
                                result["status_errors"] + result["socket_errors"],
                                mean_batch,
                                base_rps,
                                rows_per_s / base_rps,
                            )
                            cells.append(cell)
                            print(format_row(cell), flush=True)
    batch1_ms = 1000.0 / inprocess.rows_per_s(1)
    print()
    print(table(cells, batch1_ms, args))
    if len(args.server_dirs) > 1:
        print()
        print(comparison(cells))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"inprocess_batch1_ms": batch1_ms, "cells": [asdict(c) for c in cells]}, indent=2)
        )
    if args.plot:
        plot(cells, args.plot)
    return 0


def comparison(cells: list[Cell]) -> str:
    """Each checkout's median req/s and p99 per cell, as a ratio of the first checkout's."""
    from statistics import median

    def key(c: Cell) -> tuple[int, str, int, int, float]:
        return (c.workers, c.encoding, c.rows_per_request, c.concurrency, c.max_wait_ms)

    servers = list(dict.fromkeys(c.server for c in cells))
    lines = [
        "| workers | encoding | r | C | " + " | ".join(f"{s}: req/s, p99 ms" for s in servers) + " | req/s, p99 vs "
        f"{servers[0]} |",
        "|" + "---|" * (5 + len(servers)),
    ]
    for cell_key in dict.fromkeys(key(c) for c in cells):
        figures = {}
        for server in servers:
            runs = [c for c in cells if c.server == server and key(c) == cell_key]
            figures[server] = (median(c.requests_per_s for c in runs), median(c.p99_ms for c in runs))
        first = figures[servers[0]]
        ratios = ", ".join(
            f"{s}: {figures[s][0] / first[0]:.2f}x, {figures[s][1] / first[1]:.2f}x" for s in servers[1:]
        )
        lines.append(
            f"| {cell_key[0]} | {cell_key[1]} | {cell_key[2]} | {cell_key[3]} | "
            + " | ".join(f"{figures[s][0]:,.0f}, {figures[s][1]:.2f}" for s in servers)
            + f" | {ratios} |"
        )
    return "\n".join(lines)


HEADER = (
    "| server | workers | encoding | r | C | max_wait ms | req/s | rows/s | p50 ms | p99 ms | p99/p50 | errors "
    "| rows/batch | in-process rows/s at that batch | ratio |"
)


def format_row(c: Cell) -> str:
    return (
        f"| {c.server} | {c.workers} | {c.encoding} | {c.rows_per_request} | {c.concurrency} | {c.max_wait_ms:g} "
        f"| {c.requests_per_s:,.0f} | {c.rows_per_s:,.0f} | {c.p50_ms:.2f} | {c.p99_ms:.2f} "
        f"| {c.p99_ms / c.p50_ms:.1f} | {c.errors} | {c.mean_batch_rows:.1f} "
        f"| {c.inprocess_rows_per_s:,.0f} | {c.ratio:.0%} |"
    )


def table(cells: list[Cell], batch1_ms: float, args: argparse.Namespace) -> str:
    lines = [
        f"FFN d_model {args.d_model}, d_ff {args.d_ff}, {args.activation}, float32; server on cores {args.server_cpus} "
        f"(1 torch thread per worker), wrk on cores {args.client_cpus}; {args.seconds:g} s per cell",
        f"in-process batch-1 forward: {batch1_ms:.3f} ms",
        "",
        HEADER,
        "|" + "---|" * (HEADER.count("|") - 1),
    ]
    lines += [format_row(c) for c in cells]
    return "\n".join(lines)


def plot(cells: list[Cell], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    several_waits, several_workers = len({c.max_wait_ms for c in cells}) > 1, len({c.workers for c in cells}) > 1
    for key in sorted({(c.workers, c.encoding, c.rows_per_request, c.max_wait_ms) for c in cells}):
        workers, encoding, rows, wait = key
        sel = [c for c in cells if (c.workers, c.encoding, c.rows_per_request, c.max_wait_ms) == key]
        label = (
            f"{encoding}, r={rows}"
            + (f", wait {wait:g} ms" if several_waits else "")
            + (f", {workers} workers" if several_workers else "")
        )
        xs = [c.concurrency for c in sel]
        left.plot(xs, [c.ratio * 100 for c in sel], marker="o", label=label)
        right.plot(xs, [c.p99_ms for c in sel], marker="o", label=label)
    left.set(
        xscale="log",
        xlabel="concurrency C",
        ylabel="% of in-process rows/s at the formed batch",
        title="Throughput vs the in-process model",
    )
    right.set(xscale="log", yscale="log", xlabel="concurrency C", ylabel="p99 latency (ms)", title="Tail latency")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
