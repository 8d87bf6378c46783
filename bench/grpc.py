"""HTTP binary against gRPC (raw contents, unary and streaming), in one run on one server: rows/s, p50, p99.

    python3 -m bench.grpc                                   # r in {1,16,256}, C in {1,16,64}, 5 s x 3 repeats
    python3 -m bench.grpc --seconds 2 --repeats 1 --rows 1 16 --concurrency 1 16 --json out/grpc.json

One ffn-serve (the built-in demo model, d_model 512, d_ff 2048, float32; one torch thread) runs
pinned to `--server-cpus`; the load comes from ffn-loadtest's generator (ffn_client.load.run_load)
in this process, pinned to `--client-cpus`: its lean HTTP/1.1 sender with Triton's binary tensor
extension (V2 `/infer`, the binary body tritonclient.http sends), and its gRPC senders, which send
prebuilt ModelInferRequests (raw_input_contents, as tritonclient.grpc sends them) as unary calls
or one at a time on each of C streams. Every cell is run `--repeats` times, the three protocols
taking turns within each repeat (so that drift on a busy machine hits all three alike); the table
gives each one's median rows/s, p50 and p99, and gRPC's rows/s as a ratio of HTTP's in the same
run, and its p50 as a difference from HTTP's. The tester's own CPU per request is printed too:
a Python gRPC client costs more than the raw HTTP one, and on a busy core that shows in latency.

Then, where the time goes, in CPU time (which a busy machine disturbs far less than latency):
the server's CPU per request for each protocol over `--cpu-requests` sequential requests (read
from /proc), and what the gRPC door costs HTTP: the server's idle CPU, and HTTP's p50 at r=1,
C=1, with gRPC on and off (`FFN_GRPC=false`), `--off-repeats` runs each, in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ffn_client.load import LoadConfig, run_load
from ffn_testing import ServerProcess, start_server

PROTOCOLS = ("http", "grpc", "grpc-stream")  # the first is the baseline
LABELS = {"http": "HTTP binary", "grpc": "gRPC", "grpc-stream": "gRPC stream"}


@dataclass
class Cell:
    protocol: str
    rows_per_request: int
    concurrency: int
    rows_per_s: float  # medians over the repeats
    p50_ms: float
    p99_ms: float
    client_us_per_request: float
    errors: int
    repeats: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--seconds", type=float, default=5.0, help="measured seconds per run (after 0.5 s of warm-up)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--server-cpus", default="0", help="taskset list for the server")
    p.add_argument("--client-cpus", default="1", help="CPUs of this process, the load generator")
    p.add_argument("--cpu-requests", type=int, default=1500, help="sequential requests per CPU figure; 0: none")
    p.add_argument("--off-repeats", type=int, default=4, help="runs each with gRPC on and off; 0: none")
    p.add_argument("--json", type=Path, help="write the cells as JSON here")
    return p.parse_args(argv)


def pinned(cpus: str) -> list[str]:
    return ["taskset", "-c", cpus] if shutil.which("taskset") else []


def config(server: ServerProcess, protocol: str, rows: int, concurrency: int, seconds: float) -> LoadConfig:
    over_http = protocol == "http"
    return LoadConfig(
        url=server.url if over_http else f"grpc://{server.grpc_target}",
        protocol=protocol,
        encoding="v2-binary",
        rows=(rows, rows),
        concurrency=concurrency,
        duration=seconds,
        warmup=0.5,
        d_model=512,
        metrics_url="",  # no /metrics scrape inside the measured window
        timeout=60.0,
    )


async def measure(server: ServerProcess, args: argparse.Namespace) -> list[Cell]:
    cells = []
    for rows in args.rows:
        for concurrency in args.concurrency:
            runs: dict[str, list] = {protocol: [] for protocol in PROTOCOLS}
            for _ in range(args.repeats):
                for protocol in PROTOCOLS:
                    report = await run_load(config(server, protocol, rows, concurrency, args.seconds))
                    runs[protocol].append(report.to_dict())
            for protocol, reports in runs.items():
                cell = Cell(
                    protocol,
                    rows,
                    concurrency,
                    statistics.median(r["rows_per_s"] for r in reports),
                    statistics.median(r["latency_ms"]["p50"] for r in reports),
                    statistics.median(r["latency_ms"]["p99"] for r in reports),
                    statistics.median(r["client_cpu"]["us_per_request"] for r in reports),
                    sum(sum(r["counts"]["errors"].values()) for r in reports),
                    args.repeats,
                )
                cells.append(cell)
                print(f"  r={rows:<4} C={concurrency:<3} {LABELS[protocol]:<12} {format_cell(cell)}", file=sys.stderr)
    return cells


def format_cell(c: Cell) -> str:
    return f"{c.rows_per_s:>10,.0f} rows/s  p50 {c.p50_ms:7.2f}  p99 {c.p99_ms:7.2f} ms  tester {c.client_us_per_request:5.0f} µs/req"


def table(cells: list[Cell]) -> str:
    by = {(c.protocol, c.rows_per_request, c.concurrency): c for c in cells}
    head = "| r | C | " + " | ".join(f"{LABELS[p]} rows/s, p50, p99 (ms)" for p in PROTOCOLS)
    head += " | gRPC / HTTP rows/s | gRPC − HTTP p50 (ms) | stream / HTTP rows/s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for rows, concurrency in sorted({(c.rows_per_request, c.concurrency) for c in cells}):
        http, unary, stream = (by[(p, rows, concurrency)] for p in PROTOCOLS)
        measured = " | ".join(f"{c.rows_per_s:,.0f}, {c.p50_ms:.2f}, {c.p99_ms:.2f}" for c in (http, unary, stream))
        lines.append(
            f"| {rows} | {concurrency} | {measured} | {unary.rows_per_s / http.rows_per_s:.2f}× "
            f"| {unary.p50_ms - http.p50_ms:+.2f} | {stream.rows_per_s / http.rows_per_s:.2f}× |"
        )
    return "\n".join(lines)


def goals(cells: list[Cell]) -> list[str]:
    by = {(c.protocol, c.rows_per_request, c.concurrency): c for c in cells}
    out = []
    if ("http", 16, 16) in by:
        ratio = by[("grpc", 16, 16)].rows_per_s / by[("http", 16, 16)].rows_per_s
        out.append(
            f"goal: gRPC rows/s at r=16, C=16 at least HTTP binary's: {ratio:.2f}× ({'met' if ratio >= 1 else 'missed'})"
        )
    if ("http", 1, 1) in by:
        delta = by[("grpc", 1, 1)].p50_ms - by[("http", 1, 1)].p50_ms
        out.append(
            f"goal: gRPC p50 at r=1, C=1 within 0.1 ms of HTTP's: {delta:+.3f} ms ({'met' if delta <= 0.1 else 'missed'})"
        )
    return out


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (Linux: /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def server_cpu_per_request(server: ServerProcess, requests: int) -> list[str]:
    lines = []
    for protocol in PROTOCOLS:
        for rows in (1, 16):
            load = config(server, protocol, rows, 1, 1.0)
            load.duration, load.requests, load.warmup = None, requests, 0.0
            before = cpu_seconds(server.pid)
            report = await run_load(load)
            spent = cpu_seconds(server.pid) - before
            lines.append(
                f"server CPU per request, {LABELS[protocol]:<12} r={rows:<3} {1e6 * spent / report.sent:7.0f} µs "
                f"(tester {1e6 * report.client_cpu_s / report.sent:5.0f} µs)"
            )
    return lines


async def grpc_on_and_off(args: argparse.Namespace, env: dict[str, str]) -> list[str]:
    p50s: dict[str, list[float]] = {"true": [], "false": []}
    idle: dict[str, list[float]] = {"true": [], "false": []}
    for i in range(2 * args.off_repeats):
        on = "true" if i % 4 in (1, 2) else "false"  # off, on, on, off, ...: drift hits both alike
        with start_server(env={**env, "FFN_GRPC": on}, prefix=pinned(args.server_cpus)) as server:
            before = cpu_seconds(server.pid)
            await asyncio.sleep(3.0)
            idle[on].append(100 * (cpu_seconds(server.pid) - before) / 3.0)
            report = await run_load(config(server, "http", 1, 1, args.seconds))
            p50s[on].append(report.latency_ms["p50"])
    return [
        f"gRPC {'on ' if on == 'true' else 'off'}: server idle CPU {min(idle[on]):.1f}-{max(idle[on]):.1f} %, "
        f"HTTP binary p50 at r=1, C=1 {min(p50s[on]):.2f}-{max(p50s[on]):.2f} ms (median {statistics.median(p50s[on]):.2f})"
        for on in ("true", "false")
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("taskset"):
        os.sched_setaffinity(0, {int(cpu) for cpu in args.client_cpus.split(",")})
    env = {"FFN_TORCH_THREADS": "1", "FFN_LOG_LEVEL": "warning", "FFN_MAX_QUEUE_ROWS": str(256 * 64 * 2)}
    with start_server(env=env, prefix=pinned(args.server_cpus)) as server:
        cells = asyncio.run(measure(server, args))
        cpu_lines = asyncio.run(server_cpu_per_request(server, args.cpu_requests)) if args.cpu_requests else []
    off_lines = asyncio.run(grpc_on_and_off(args, env)) if args.off_repeats else []
    print(table(cells))
    for line in [*goals(cells), *cpu_lines, *off_lines]:
        print(line)
    errors = sum(c.errors for c in cells)
    if errors:
        print(f"{errors} requests failed: see the JSON for their causes", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(c) for c in cells], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
