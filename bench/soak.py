"""Soak test: steady mixed load for N minutes while the server's resident memory is sampled.

Not run in CI. It starts `python -m app.cli` on a free 127.0.0.1 port (or targets --url, and
samples --pid if given), drives it with a few workers sending prebuilt requests of every
encoding and a spread of row counts, reads VmRSS from /proc/<pid>/status every few seconds, and
prints RSS at start and end, growth, requests and outcomes by status. It stops by itself.

    python3 bench/soak.py --minutes 10
    python3 bench/soak.py --url http://127.0.0.1:8000 --pid 1234 --minutes 30 --concurrency 16

A leak shows as RSS that keeps rising after the first minute (the allocator's and torch's
caches fill in the first seconds); compare `growth after warm-up` with the per-request size.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from ffn_client import Client
from ffn_client.encodings import EncodedRequest, encode_request
from ffn_testing import read_rss, start_server

REPO_ROOT = Path(__file__).resolve().parent.parent
D_MODEL = 512
WARM_UP_S = 60.0  # RSS growth is also reported from this point on
SERVER_DEADLINE_MS = 30_000.0
# (encoding, wire dtype) of the requests, cycled through in this order.
KINDS = (
    ("json", "float32"),
    ("binary", "float32"),
    ("binary", "float16"),
    ("binary", "bfloat16"),
    ("npy", "float32"),
    ("npy", "float16"),
    ("v2-json", "float32"),
    ("v2-binary", "float32"),
)


# ----- requests --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prebuilt:
    kind: str
    request: EncodedRequest
    expect: int = 200


def build_requests(model: str, count: int, max_rows: int, seed: int = 0) -> list[Prebuilt]:
    """`count` requests over every encoding, rows 1..max_rows, a few deliberately invalid (400)."""
    rng = np.random.default_rng(seed)
    out: list[Prebuilt] = []
    for i in range(count):
        rows = int(rng.integers(1, max_rows + 1))
        x = rng.standard_normal((rows, D_MODEL)).astype(np.float32)
        encoding, dtype = KINDS[i % len(KINDS)]
        request = encode_request(model, x, encoding, dtype, timeout_ms=SERVER_DEADLINE_MS)
        out.append(Prebuilt(f"{encoding}-{dtype}", request))
    for _ in range(max(1, count // 50)):  # a few bad requests keep the error paths in the soak
        bad = rng.standard_normal((2, D_MODEL - 1)).astype(np.float32)
        out.append(Prebuilt("invalid", encode_request(model, bad, "json"), expect=400))
    return out


# ----- load --------------------------------------------------------------------------------------


@dataclass
class Tally:
    sent: int = 0
    rows: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[str] = field(default_factory=Counter)
    unexpected: Counter[str] = field(default_factory=Counter)  # "<kind> <status>" that was not expected


async def worker(client: httpx.AsyncClient, requests: list[Prebuilt], stop_at: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    while time.monotonic() < stop_at:
        req = rng.choice(requests)
        tally.sent += 1
        tally.by_kind[req.kind] += 1
        try:
            response = await client.post(req.request.path, content=req.request.body, headers=req.request.headers)
            status = str(response.status_code)
            if response.status_code == 200:
                tally.rows += req.request.rows
        except httpx.TransportError as exc:
            status = type(exc).__name__
            await asyncio.sleep(0.1)  # the server is gone or refusing: do not spin
        tally.by_status[status] += 1
        if status != str(req.expect):
            tally.unexpected[f"{req.kind} {status}"] += 1


async def sample_rss(
    pid: int | None, stop_at: float, every_s: float, samples: list[tuple[float, int]], tally: Tally, started: float
) -> None:
    next_print = started + 60.0
    while True:
        now = time.monotonic()
        if pid is not None:
            samples.append((now - started, read_rss(pid)))
        if now >= next_print:
            rss = f"{samples[-1][1] / 2**20:.1f} MiB" if samples else "n/a"
            print(f"  {now - started:6.0f} s  requests {tally.sent:8d}  rss {rss}", flush=True)
            next_print += 60.0
        if now >= stop_at:
            return
        await asyncio.sleep(min(every_s, max(0.0, stop_at - now)))


async def soak(url: str, pid: int | None, args: argparse.Namespace) -> tuple[Tally, list[tuple[float, int]], float]:
    requests = build_requests(args.model, args.distinct, args.max_rows)
    tally = Tally()
    samples: list[tuple[float, int]] = []
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits) as client:
        started = time.monotonic()
        stop_at = started + args.minutes * 60.0
        tasks = [asyncio.create_task(worker(client, requests, stop_at, tally, seed=i)) for i in range(args.concurrency)]
        tasks.append(asyncio.create_task(sample_rss(pid, stop_at, args.sample_s, samples, tally, started)))
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - started
        try:
            metrics = (await client.get("/metrics")).text
            lines = [line for line in metrics.splitlines() if line.startswith("ffn_requests_total")]
            print("server counters:\n  " + "\n  ".join(lines))
        except httpx.HTTPError as exc:
            print(f"could not read /metrics: {exc}")
    return tally, samples, elapsed


# ----- report ------------------------------------------------------------------------------------


def report(tally: Tally, samples: list[tuple[float, int]], elapsed: float) -> None:
    mib = 2**20
    print(f"\nduration            {elapsed:.0f} s")
    print(f"requests            {tally.sent}  ({tally.sent / elapsed:.1f}/s), rows answered {tally.rows}")
    print("by status           " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.by_status.items())))
    print("by kind             " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.by_kind.items())))
    unexpected = sum(tally.unexpected.values())
    print(f"unexpected          {unexpected}" + (f"  {dict(tally.unexpected)}" if unexpected else ""))
    if not samples:
        print("rss                 not sampled (give --pid with --url)")
        return
    start, end = samples[0][1], samples[-1][1]
    peak = max(rss for _, rss in samples)
    warm = next((rss for t, rss in samples if t >= WARM_UP_S), start)
    print(f"rss start           {start / mib:.1f} MiB")
    print(f"rss after {WARM_UP_S:.0f} s      {warm / mib:.1f} MiB")
    print(f"rss end             {end / mib:.1f} MiB  (peak {peak / mib:.1f} MiB, {len(samples)} samples)")
    print(f"growth              {(end - start) / mib:+.1f} MiB overall, {(end - warm) / mib:+.1f} MiB after warm-up")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to drive load (default 10)")
    parser.add_argument("--url", help="target a running server instead of starting one")
    parser.add_argument("--pid", type=int, help="with --url: the server's pid, to sample its RSS")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent workers (default 8)")
    parser.add_argument("--max-rows", type=int, default=64, help="rows per request: 1..this (default 64)")
    parser.add_argument("--distinct", type=int, default=96, help="prebuilt requests to cycle through")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="FFN_X=V",
        help="extra environment for the started server (repeatable)",
    )
    args = parser.parse_args(argv)

    if args.url:
        with Client(args.url, timeout=2.0) as client:
            client.wait_ready(timeout=120.0)
        tally, samples, elapsed = run(args.url.rstrip("/"), args.pid, args)
    else:
        env = {"FFN_LOG_LEVEL": "warning", **dict(item.split("=", 1) for item in args.env)}
        with start_server(env=env, cwd=REPO_ROOT, ready_timeout=120.0) as server:
            tally, samples, elapsed = run(server.url, server.pid, args)
            print(f"server exit code    {server.stop(60.0)} after SIGTERM")
    report(tally, samples, elapsed)
    return 0 if not tally.unexpected else 1


def run(url: str, pid: int | None, args: argparse.Namespace) -> tuple[Tally, list[tuple[float, int]], float]:
    print(
        f"soak: {args.minutes:g} min against {url} (pid {pid}), {args.concurrency} workers, rows 1..{args.max_rows}",
        flush=True,
    )
    return asyncio.run(soak(url, pid, args))


if __name__ == "__main__":
    sys.exit(main())
