"""Triton's perf_analyzer and ffn-loadtest against one ffn-serve, over the same cells, in one run.

    python3 -m bench.perf_analyzer                                    # --concurrency-range 1:64:2, perf_analyzer's defaults
    python3 -m bench.perf_analyzer --concurrency-range 1:64:2 --interval-ms 1000 --stability 100 --loadtest-seconds 2

perf_analyzer (PyPI perf-analyzer, NVIDIA's, the tool Triton users benchmark with) sweeps the
closed-loop concurrency over the V2 HTTP protocol with batch-1 requests ([1, d_model] FP32 zeros,
binary tensors: `--input-data zero`; its default random data holds NaN and values near 3e38,
which the service refuses). Its sweep finishing at all is the first check: it stops at a cell
whose server statistics it cannot use. Then ffn-loadtest runs the same cells (closed loop,
1 row, v2-binary, the same server) and the table puts the two side by side: requests/s, p50 and
p99 at the client, and perf_analyzer's own reading of the server's statistics (queue and
compute per request, and the overhead it computes from them).

perf_analyzer's wheel needs glibc 2.38: a `perf_analyzer` on the PATH is used, else
scripts/perf-analyzer.sh, which runs it under Debian trixie's loader and libraries unpacked in a
private folder (docs/load-testing.md); `--perf-analyzer` names another command. The server is pinned to core 0
and both clients to core 1 where taskset exists, as in bench.serve.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.serve import pinned
from ffn_testing import start_server

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "perf-analyzer.sh"  # perf_analyzer where glibc is older than 2.38
D_MODEL = 512  # the built-in demo model


@dataclass
class Cell:
    concurrency: int
    pa_requests_per_s: float
    pa_p50_ms: float
    pa_p99_ms: float
    pa_queue_us: float
    pa_compute_us: float
    pa_send_recv_us: float
    lt_requests_per_s: float
    lt_p50_ms: float
    lt_p99_ms: float
    lt_errors: int


def perf_analyzer_command(given: str | None) -> list[str]:
    if given:
        return given.split()
    if shutil.which("perf_analyzer"):
        return ["perf_analyzer"]
    return ["bash", str(SCRIPT)]


def run_perf_analyzer(command: list[str], address: str, args: argparse.Namespace, folder: Path) -> list[dict]:
    """perf_analyzer's sweep; one CSV row per concurrency (it writes them only once the whole sweep ends)."""
    out = folder / "perf_analyzer.csv"
    argv = [
        *pinned(args.client_cpus),
        *command,
        "-m",
        "demo",
        "-u",
        address,
        "-i",
        "http",
        "--concurrency-range",
        args.concurrency_range,
        "--input-data",
        "zero",
        "--shape",
        f"input:1,{D_MODEL}",
        "--measurement-interval",
        str(args.interval_ms),
        "--stability-percentage",
        str(args.stability),
        "-f",
        str(out),
        "--verbose-csv",
    ]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=folder)
    if result.returncode != 0 or not out.exists():
        print(result.stdout[-4000:], result.stderr[-4000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"perf_analyzer exited with {result.returncode} before the sweep ended")
    with out.open() as f:
        return list(csv.DictReader(f))


def run_loadtest(url: str, concurrency: int, args: argparse.Namespace, folder: Path) -> dict:
    report = folder / f"loadtest-{concurrency}.json"
    argv = [
        *pinned(args.client_cpus),
        sys.executable,
        "-m",
        "ffn_client.loadtest",
        "--url",
        url,
        "--model",
        "demo",
        "--encoding",
        "v2-binary",
        "--rows",
        "1",
        "-c",
        str(concurrency),
        "-d",
        str(args.loadtest_seconds),
        "--warmup",
        "1",
        "--json",
        str(report),
        "-q",
    ]
    subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(report.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency-range", default="1:64:2", help="perf_analyzer's START:END:STEP (linear)")
    p.add_argument("--interval-ms", type=int, default=5000, help="perf_analyzer's measurement window")
    p.add_argument("--stability", type=int, default=10, help="perf_analyzer's stability percentage")
    p.add_argument("--loadtest-seconds", type=float, default=5.0, help="ffn-loadtest's measured seconds per cell")
    p.add_argument("--perf-analyzer", help="the command that runs perf_analyzer (default: scripts/perf-analyzer.sh)")
    p.add_argument("--server-cpus", default="0", help="taskset list for the server")
    p.add_argument("--client-cpus", default="1", help="taskset list for both clients")
    p.add_argument("--json", type=Path, help="write the cells as JSON here")
    args = p.parse_args(argv)
    command = perf_analyzer_command(args.perf_analyzer)
    env = {"FFN_LOG_LEVEL": "warning", "FFN_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cells: list[Cell] = []
    with tempfile.TemporaryDirectory() as tmp, start_server(env, prefix=pinned(args.server_cpus)) as server:
        folder = Path(tmp)
        # perf_analyzer's CSV lists its cells by throughput; the table follows the concurrency.
        rows = sorted(
            run_perf_analyzer(command, server.url.removeprefix("http://"), args, folder),
            key=lambda row: int(row["Concurrency"]),
        )
        print(f"perf_analyzer finished its sweep: {len(rows)} cells", flush=True)
        for row in rows:
            concurrency = int(row["Concurrency"])
            report = run_loadtest(server.url, concurrency, args, folder)
            queue, compute = (
                float(row["Server Queue"]),
                sum(float(row[k]) for k in ("Server Compute Input", "Server Compute Infer", "Server Compute Output")),
            )
            counts = report["counts"]
            cells.append(
                Cell(
                    concurrency,
                    float(row["Inferences/Second"]),
                    float(row["p50 latency"]) / 1000,
                    float(row["p99 latency"]) / 1000,
                    queue,
                    compute,
                    float(row["Network+Server Send/Recv"]),
                    report["requests_per_s"],
                    report["latency_ms"]["p50"],
                    report["latency_ms"]["p99"],
                    counts["sent"] - counts["ok"],
                )
            )
            print(format_row(cells[-1]), flush=True)
    print()
    print(table(cells, args))
    if args.json:
        args.json.write_text(json.dumps([cell.__dict__ for cell in cells], indent=2))
    return 0


HEADER = (
    "| C | perf_analyzer req/s | p50 ms | p99 ms | server queue µs | server compute µs | network+server send/recv µs "
    "| ffn-loadtest req/s | p50 ms | p99 ms | errors | req/s ratio (loadtest / perf_analyzer) |"
)


def format_row(c: Cell) -> str:
    return (
        f"| {c.concurrency} | {c.pa_requests_per_s:,.0f} | {c.pa_p50_ms:.2f} | {c.pa_p99_ms:.2f} | {c.pa_queue_us:.0f} "
        f"| {c.pa_compute_us:.0f} | {c.pa_send_recv_us:.0f} | {c.lt_requests_per_s:,.0f} | {c.lt_p50_ms:.2f} "
        f"| {c.lt_p99_ms:.2f} | {c.lt_errors} | {c.lt_requests_per_s / c.pa_requests_per_s:.2f} |"
    )


def table(cells: list[Cell], args: argparse.Namespace) -> str:
    lines = [
        f"demo model (d_model 512, d_ff 2048, float32), batch-1 V2 binary requests; server on cores "
        f"{args.server_cpus} (1 torch thread), clients on {args.client_cpus}; perf_analyzer "
        f"--concurrency-range {args.concurrency_range} --measurement-interval {args.interval_ms} "
        f"--stability-percentage {args.stability}; ffn-loadtest {args.loadtest_seconds:g} s per cell",
        "",
        HEADER,
        "|" + "---|" * (HEADER.count("|") - 1),
    ]
    return "\n".join([*lines, *(format_row(c) for c in cells)])


if __name__ == "__main__":
    sys.exit(main())
