"""The service over HTTP at 1..N workers against the echo baseline, with the load generator on other cores.

Each cell starts nothing: `serving(...)` starts one server (ffn-serve with FFN_WORKERS, or the
echo app under uvicorn's --workers) pinned to the server cores, and `load(...)` drives it from
the client cores with wrk (one thread a core, closed loop, one prepared body) or, where wrk is
missing, with ffn-loadtest processes (one a core). The server's CPU time over the measured
window (its whole process tree, from /proc) says where the time goes: CPU per request.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import ssl
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from bench import serve
from ffn_client.encodings import encode_request
from ffn_testing import ServerProcess, metric_value, start_server

LUA = Path(__file__).resolve().parents[1] / "wrk" / "post.lua"
MODEL = "ffn"
SHARED = "ffn+engine"  # the server kind of issue 30's layout: fronts and one engine process


@dataclass(frozen=True)
class BenchTls:
    """A CA and a certificate and key for 127.0.0.1 it signed: servers serve HTTPS with them, loads trust the CA."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def made_in(cls, folder: Path) -> BenchTls:
        import trustme  # the test extra's; only where TLS is measured

        ca = trustme.CA()
        leaf = ca.issue_cert("127.0.0.1", "localhost")
        tls = cls(folder / "bench-ca.pem", folder / "bench-cert.pem", folder / "bench-key.pem")
        ca.cert_pem.write_to_path(str(tls.ca))
        leaf.cert_chain_pems[0].write_to_path(str(tls.cert))
        leaf.private_key_pem.write_to_path(str(tls.key))
        return tls

    def env(self) -> dict[str, str]:
        """ffn-serve's settings for it."""
        return {"FFN_TLS_CERT_FILE": str(self.cert), "FFN_TLS_KEY_FILE": str(self.key)}


@dataclass
class LoadResult:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    generator: str  # "wrk" or "ffn-loadtest"


@dataclass
class ServiceCell:
    server: str  # "ffn" or "echo"
    workers: int
    rows: int  # per request
    concurrency: int
    requests_per_s: float
    rows_per_s: float
    bytes_per_s: float  # request and answer bodies
    p50_ms: float
    p99_ms: float
    errors: int
    server_cpu_ms_per_request: float
    mean_batch_rows: float  # NaN for the echo server, or where the metrics could not be read
    generator: str


def split_cores(count: int | None = None, available: list[int] | None = None) -> tuple[list[int], list[int]]:
    """(server cores, client cores): the first half of the first `count` cores this process may use, and the rest."""
    if available is None:
        available = (
            sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        )
    cores = available[: count or len(available)]
    if len(cores) < 2:
        return cores, cores
    half = len(cores) // 2
    return cores[:half], cores[half:]


def pinned(cores: list[int]) -> list[str]:
    return serve.pinned(",".join(map(str, cores)))


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds of `root` and all its descendants, from /proc (0.0 where /proc is missing)."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = entry.joinpath("stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        pid = int(entry.name)
        stats[pid] = fields
        children.setdefault(int(fields[1]), []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += (int(stats[pid][11]) + int(stats[pid][12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        todo += children.get(pid, [])
    return total


def model_config(folder: Path, weights: str, dtype: str) -> Path:
    config = folder / "ffn.toml"
    config.write_text(f'[[models]]\nname = "{MODEL}"\nweights = "{weights}"\ndtype = "{dtype}"\n')
    return config


@contextlib.contextmanager
def serving(
    server: str, workers: int, cores: list[int], config: Path, torch_threads: int, tls: BenchTls | None = None
) -> Iterator[ServerProcess]:
    """A ready server of `server` kind with `workers` processes, pinned to `cores`.

    "ffn": `workers` copies of the service; "ffn+engine": `workers` fronts and one engine process
    (FFN_SHARED_ENGINE), the engine with the torch threads of all the cores; "echo": the baseline.
    `tls`: the echo serves HTTPS with it (uvicorn's own SSL options)."""
    if server in ("ffn", SHARED):
        env = {
            "FFN_WORKERS": str(workers),
            "FFN_TORCH_THREADS": str(torch_threads),
            "FFN_LOG_LEVEL": "warning",
            "OMP_NUM_THREADS": str(torch_threads),
            "FFN_MAX_QUEUE_ROWS": str(1 << 20),
        }
        if server == SHARED:
            env |= {"FFN_SHARED_ENGINE": "true", "FFN_TORCH_THREADS": "0", "OMP_NUM_THREADS": str(len(cores))}
        elif workers == 1:
            env.pop("FFN_WORKERS")  # also where the setting does not exist yet
        with start_server(env, config, prefix=pinned(cores), ready_timeout=300.0) as process:
            yield process
    else:
        command = [
            sys.executable,
            "-m",
            "uvicorn",
            "bench.gpu.echo:app",
            "--workers",
            str(workers),
            "--no-server-header",
            "--no-proxy-headers",  # as ffn-serve runs: no proxy-headers middleware around the app
            "--no-access-log",
            "--log-level",
            "warning",
        ]
        if tls is not None:
            command += ["--ssl-certfile", str(tls.cert), "--ssl-keyfile", str(tls.key)]
        root = Path(__file__).resolve().parents[2]  # `python -m` imports bench.gpu.echo from the working folder
        with start_server(
            {},
            None,
            prefix=pinned(cores),
            command=command,
            cwd=root,
            ready_timeout=120.0,
            verify=None if tls is None else tls.ca,
        ) as process:
            yield process


def prepared_body(rows: int, d_model: int, folder: Path) -> tuple[Path, dict[str, str], int]:
    """A binary float32 request of `rows` rows: its body file, headers, and body bytes."""
    x = np.random.default_rng(rows).standard_normal((rows, d_model)).astype(np.float32)
    request = encode_request(MODEL, x, "binary")
    path = folder / f"body-{rows}"
    path.write_bytes(request.body)
    return path, dict(request.headers), len(request.body)


def load(
    generator: str,
    url: str,
    body: Path,
    headers: dict[str, str],
    rows: int,
    d_model: int,
    concurrency: int,
    seconds: float,
    cores: list[int],
    cacert: Path | None = None,
) -> LoadResult:
    """Closed-loop load for `seconds` with `concurrency` connections, from `cores`, by wrk or ffn-loadtest.

    An https `url`: wrk speaks TLS without checking the certificate; ffn-loadtest checks it against `cacert`."""
    if generator == "wrk":
        return _wrk(url, body, headers, concurrency, seconds, cores)
    return _loadtest(url, rows, d_model, concurrency, seconds, cores, cacert)


def _wrk(
    url: str, body: Path, headers: dict[str, str], concurrency: int, seconds: float, cores: list[int]
) -> LoadResult:
    threads = max(1, min(len(cores), concurrency))
    env = os.environ | {"BENCH_BODY": str(body), "BENCH_HEADERS": "|".join(f"{k}: {v}" for k, v in headers.items())}
    command = [
        *pinned(cores),
        "wrk",
        f"-t{threads}",
        f"-c{concurrency}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "10s",
        "-s",
        str(LUA),
        f"{url}/v1/models/{MODEL}/transform",
    ]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return LoadResult(
        result["requests"],
        result["duration_us"] / 1e6,
        result["p50_us"] / 1000,
        result["p99_us"] / 1000,
        result["status_errors"] + result["socket_errors"],
        "wrk",
    )


def _loadtest(
    url: str, rows: int, d_model: int, concurrency: int, seconds: float, cores: list[int], cacert: Path | None = None
) -> LoadResult:
    """ffn-loadtest, one process a client core (each a single-threaded asyncio loop), summed."""
    processes = max(1, min(len(cores), concurrency))
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    procs = [
        subprocess.Popen(
            [
                *pinned([cores[i % len(cores)]]),
                sys.executable,
                "-m",
                "ffn_client.loadtest",
                "--url",
                url,
                "--model",
                MODEL,
                "--d-model",
                str(d_model),
                "--encoding",
                "binary",
                "--rows",
                str(rows),
                "--concurrency",
                str(share),
                "--duration",
                str(seconds),
                # measure_cell warms up before it; a warm-up or /metrics scrapes here would fall inside
                # its server-CPU window without counting as requests (+30 % of CPU per request at C=1).
                "--warmup",
                "0",
                "--metrics-url",
                "",
                "--json",
                "-",
                "--quiet",
                *(["--cacert", str(cacert)] if cacert is not None else []),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i, share in enumerate(shares)
    ]
    reports = []
    for proc in procs:
        out, _ = proc.communicate(timeout=seconds + 120)
        reports.append(json.loads(out[out.index("{") :]))
    ok = sum(r["counts"]["ok"] for r in reports)
    errors = sum(sum(r["counts"]["errors"].values()) for r in reports)
    # Percentiles do not add up: the worst process's is the conservative figure.
    return LoadResult(
        ok + errors,
        max(r["duration_s"] for r in reports),
        max(r["latency_ms"]["p50"] for r in reports),
        max(r["latency_ms"]["p99"] for r in reports),
        errors,
        "ffn-loadtest",
    )


def batch_counts(url: str, cacert: Path | None = None) -> tuple[float, float]:
    """(rows, batches) the ffn model ran so far, from /metrics; NaNs where they cannot be read."""
    verify = ssl.create_default_context(cafile=str(cacert)) if cacert is not None else True
    try:
        page = httpx.get(f"{url}/metrics", timeout=10, verify=verify).text
    except httpx.HTTPError:
        return math.nan, math.nan
    return metric_value(page, "ffn_batch_rows_sum", model=MODEL), metric_value(
        page, "ffn_batch_rows_count", model=MODEL
    )


def warm_up_seconds(seconds: float) -> float:
    """The untimed load before each cell's `seconds`: 1 s, or as long as the cell in a quick run."""
    return min(1.0, seconds)


def measure_cell(
    server: str,
    process: ServerProcess,
    workers: int,
    rows: int,
    concurrency: int,
    seconds: float,
    d_model: int,
    folder: Path,
    client_cores: list[int],
    generator: str,
    cacert: Path | None = None,
) -> ServiceCell:
    """One cell's load and the server's CPU over it; `cacert`: the CA of a server that serves HTTPS."""
    body, headers, nbytes = prepared_body(rows, d_model, folder)
    send = functools.partial(load, generator, process.url, body, headers, rows, d_model, concurrency)
    send(warm_up_seconds(seconds), client_cores, cacert)  # not counted
    before_rows, before_batches = batch_counts(process.url, cacert) if server != "echo" else (math.nan, math.nan)
    cpu_before = tree_cpu_seconds(process.pid)
    result = send(seconds, client_cores, cacert)
    cpu = tree_cpu_seconds(process.pid) - cpu_before
    after_rows, after_batches = batch_counts(process.url, cacert) if server != "echo" else (math.nan, math.nan)
    ok = result.requests - result.errors
    batches = after_batches - before_batches
    per_s = ok / result.seconds
    return ServiceCell(
        server,
        workers,
        rows,
        concurrency,
        per_s,
        per_s * rows,
        per_s * 2 * nbytes,
        result.p50_ms,
        result.p99_ms,
        result.errors,
        1000 * cpu / max(result.requests, 1),
        (after_rows - before_rows) / batches if batches and batches > 0 else math.nan,
        result.generator,
    )


def measure(
    weights: Path,
    dtype: str,
    d_model: int,
    workers_list: list[int],
    rows_list: list[int],
    concurrency: int,
    seconds: float,
    cores: int | None,
    generator: str,
    progress: Callable[[str], None] = print,
    measured: Callable[[list[ServiceCell]], None] | None = None,
    servers: tuple[str, ...] = ("ffn", "echo"),
) -> list[ServiceCell]:
    """Every cell: each worker count, each of `servers` in turn, each rows; plus r=1 with one client at one worker.

    `measured` is called with the cells so far after each one, so that a run stopped at a time
    limit (the GPU machine's are short) still leaves what it measured.
    """
    server_cores, client_cores = split_cores(cores)
    cells: list[ServiceCell] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        config = model_config(folder, str(weights.resolve()), dtype)
        for workers in workers_list:
            for server in servers:
                threads = max(1, len(server_cores) // workers)
                with serving(server, workers, server_cores, config, threads) as process:
                    plan = [(rows, concurrency) for rows in rows_list]
                    if workers == workers_list[0]:
                        plan.insert(0, (1, 1))  # the latency cell: one client, one row
                    for rows, c in plan:
                        cell = measure_cell(
                            server, process, workers, rows, c, seconds, d_model, folder, client_cores, generator
                        )
                        cells.append(cell)
                        if measured is not None:
                            measured(cells)
                        progress(
                            f"service {server:>10} workers={workers} r={rows:<4} C={c:<4} "
                            f"{cell.requests_per_s:>10,.0f} req/s {cell.rows_per_s:>12,.0f} rows/s "
                            f"{cell.bytes_per_s / 1e6:>9,.1f} MB/s p50 {cell.p50_ms:.3f} ms "
                            f"p99 {cell.p99_ms:.3f} ms errors {cell.errors} "
                            f"cpu {cell.server_cpu_ms_per_request:.3f} ms/req ({cell.generator})"
                        )
    return cells
