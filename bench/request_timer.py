"""What RequestTimer (ffn_http_request_seconds) costs each request, in one run, against no timer.

    python3 -m bench.request_timer                   # 20,000 calls per timing, 7 repeats
    python3 -m bench.request_timer --calls 50000 --repeats 11

The same trivial ASGI app (a 200 with a small body) is called directly and through the timer,
the timings alternating so that a busy machine slows both alike; the median of the repeats is
reported, per call and as the difference. Both the app's real route table (the infer route
matched first, an unknown path matched by none) and prometheus_client's multiprocess mode (what
workers use) are measured. The service's own request (a batch-1 forward and both codecs) is some
100-200 µs on this machine (docs/benchmarks.md), the scale to read the difference against.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

from prometheus_client import CollectorRegistry, Histogram
from starlette.types import Receive, Scope, Send

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


async def trivial(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


async def receive() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}


async def send(message: dict) -> None:
    return None


def scope_for(path: str) -> Scope:
    return {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}


async def per_call_us(app, scope: Scope, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        await app(scope, receive, send)
    return (time.perf_counter() - started) / calls * 1e6


def timer_over(app):
    # Imported here: the multiprocess case must set PROMETHEUS_MULTIPROC_DIR before prometheus_client
    # builds a histogram's values, which happens per child at .labels().
    from app.config.settings import Settings
    from app.http.edge import Edge, route_templates
    from app.main import ENDPOINTS, create_app

    routes = route_templates(create_app(Settings(warmup=False)).routes, [e.path for e in ENDPOINTS if e.fast])
    histogram = Histogram(
        "bench_http_request_seconds",
        "",
        ["protocol", "route", "status"],
        buckets=LATENCY_BUCKETS,
        registry=CollectorRegistry(),
    )
    return Edge(app, histogram=histogram, routes=routes)


async def measure(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    timed = timer_over(trivial)
    rows = []
    for label, path in (("infer route (matched first)", "/v2/models/demo/infer"), ("unknown path", "/nope/x")):
        scope = scope_for(path)
        await per_call_us(timed, scope, 1000)  # warm: the labelled child is created once
        bare, with_timer = [], []
        for _ in range(args.repeats):
            bare.append(await per_call_us(trivial, scope, args.calls))
            with_timer.append(await per_call_us(timed, scope, args.calls))
        rows.append((label, statistics.median(bare), statistics.median(with_timer)))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20_000, help="calls per timing")
    p.add_argument("--repeats", type=int, default=7, help="timings per case; the median is reported")
    p.add_argument("--multiprocess", action="store_true", help="prometheus_client's multiprocess mode (workers)")
    args = p.parse_args(argv)
    if args.multiprocess:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="bench-timer-")
    rows = asyncio.run(measure(args))
    mode = "multiprocess (workers)" if args.multiprocess else "one process"
    print(f"RequestTimer, {mode}: median of {args.repeats} timings of {args.calls:,} calls each")
    print()
    print("| path | app alone µs/call | with RequestTimer µs/call | cost µs/call | ratio |")
    print("|---|---|---|---|---|")
    for label, bare, timed in rows:
        print(f"| {label} | {bare:.2f} | {timed:.2f} | {timed - bare:.2f} | {timed / bare:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
