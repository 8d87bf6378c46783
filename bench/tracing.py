"""The cost of tracing, in one run: off, on at 1 % sampling, on at 100 %, at r=1 row a request and C=64.

    python3 -m bench.tracing                                  # 3 repeats of 10 s per mode
    git worktree add /tmp/before <commit before tracing>
    python3 -m bench.tracing --against /tmp/before            # and the code from before, as "before"

One server per mode, all started first and then measured in turns (off, 1 %, 100 %, off, ...), so
that the machine's drifts hit every mode alike; the table gives each mode's median over the
repeats and its ratio to "off" (or to "before", with --against). Tracing exports to a real OTLP
receiver in this process (bench/otlp_receiver.py), which decodes and counts the spans. 1 % is
OpenTelemetry's own sampler (OTEL_TRACES_SAMPLER=parentbased_traceidratio, ARG 0.01); "1 % by
trace_rate" is Triton's setting (trace_rate 100, set through the trace extension), which decides
before any span is made. Servers are pinned to core 0 with one torch thread, wrk to core 1;
binary requests to the built-in demo model (d_model 512, d_ff 2048). Needs wrk and Linux.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.gpu.service import tree_cpu_seconds
from bench.otlp_receiver import OtlpReceiver
from bench.serve import pinned, request_body, run_wrk, server_env
from ffn_testing import ServerProcess, start_server

REPO_ROOT = Path(__file__).resolve().parent.parent
RATIO = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"}
MODES: dict[str, dict[str, str]] = {  # name -> tracing environment ({} is off)
    "off": {},
    "on, 1 %": RATIO,
    "on, 1 % by trace_rate": {"OTEL_TRACES_SAMPLER": "parentbased_always_on"},
    "on, 100 %": {"OTEL_TRACES_SAMPLER": "parentbased_always_on"},
}
TRACE_RATE = {"on, 1 % by trace_rate": "100"}


@dataclass
class Mode:
    name: str
    server: ServerProcess
    requests_per_s: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)  # server CPU time per request
    errors: int = 0
    requests: int = 0  # every request sent, warm-up included: the spans exported are of all of them
    spans: int = 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1, help="rows per request (r)")
    p.add_argument("--concurrency", type=int, default=64, help="connections (C)")
    p.add_argument("--seconds", type=float, default=10.0, help="wrk duration of one measurement")
    p.add_argument("--repeats", type=int, default=3, help="measurements per mode, taken in turns")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--against", type=Path, help="another checkout (the code before tracing), measured as 'before'")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not shutil.which("wrk"):
        print("bench.tracing needs wrk (apt-get install wrk)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        folder = Path(tmp)
        receiver = stack.enter_context(OtlpReceiver(keep=False))
        body, headers = request_body("binary", args.rows, 512, folder)
        base = server_env(max_wait_ms=0.0, max_batch_rows=1024)
        checkouts = [("before", args.against, {})] if args.against else []
        checkouts += [(name, REPO_ROOT, MODES[name]) for name in args.modes]
        modes: list[Mode] = []
        for name, checkout, tracing in checkouts:
            env = base | ({"FFN_OTLP_ENDPOINT": receiver.url, "OTEL_SERVICE_NAME": name, **tracing} if tracing else {})
            server = stack.enter_context(start_server(env=env, prefix=pinned(0), cwd=checkout, ready_timeout=180))
            if name in TRACE_RATE:
                answer = httpx.post(f"{server.url}/v2/trace/setting", json={"trace_rate": TRACE_RATE[name]})
                answer.raise_for_status()
            modes.append(Mode(name, server))
        for mode in modes:  # warm-up: first requests, first batches, the exporter's connection
            mode.requests += run_wrk(url_of(mode), body, headers, args.concurrency, 2)["requests"]
        for repeat in range(args.repeats):
            for mode in modes:
                cpu_before = tree_cpu_seconds(mode.server.pid)
                result = run_wrk(url_of(mode), body, headers, args.concurrency, args.seconds)
                cpu = tree_cpu_seconds(mode.server.pid) - cpu_before
                ok = result["requests"] - result["status_errors"]
                seconds = result["duration_us"] / 1e6
                mode.requests_per_s.append(ok / seconds)
                mode.p50_ms.append(result["p50_us"] / 1000)
                mode.p99_ms.append(result["p99_us"] / 1000)
                mode.cpu_us.append(cpu / max(1, result["requests"]) * 1e6)
                mode.errors += result["status_errors"] + result["socket_errors"]
                mode.requests += result["requests"]
                print(
                    f"repeat {repeat + 1}/{args.repeats} {mode.name}: {ok / seconds:,.0f} req/s, "
                    f"p99 {result['p99_us'] / 1000:.2f} ms",
                    file=sys.stderr,
                    flush=True,
                )
        for mode in modes:  # stopped (SIGTERM: a drain, and the last spans sent) before they are counted
            mode.server.stop()
            mode.spans = receiver.by_service[mode.name]
        print(table(modes, args))
    return 0


def url_of(mode: Mode) -> str:
    return f"{mode.server.url}/v1/models/demo/transform"


def table(modes: list[Mode], args: argparse.Namespace) -> str:
    baseline = modes[0]
    base_rps, base_cpu = statistics.median(baseline.requests_per_s), statistics.median(baseline.cpu_us)
    header = (
        "| mode | req/s (median) | ratio | server CPU µs/request | ratio | p50 ms | p99 ms | spans exported "
        "| errors | req/s of each repeat |"
    )
    lines = [
        f"r={args.rows}, C={args.concurrency}, binary, demo model (512/2048 ReLU) on 1 core, 1 torch thread; "
        f"{args.repeats} repeats of {args.seconds:g} s per mode in turns; ratios against {baseline.name!r}",
        "",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    for mode in modes:
        rps, cpu = statistics.median(mode.requests_per_s), statistics.median(mode.cpu_us)
        requests = mode.requests
        spans = f"{mode.spans:,} ({mode.spans / requests:.3f} a request)" if requests else "0"
        lines.append(
            f"| {mode.name} | {rps:,.0f} | {rps / base_rps:.1%} | {cpu:.0f} | {cpu / base_cpu:.1%} "
            f"| {statistics.median(mode.p50_ms):.2f} | {statistics.median(mode.p99_ms):.2f} | {spans} "
            f"| {mode.errors} | {', '.join(f'{r:,.0f}' for r in mode.requests_per_s)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
