"""Where the latency tail comes from: one bench.serve cell, with every garbage-collector pass timed.

    python3 -m bench.tail                         # binary, r=1, C=64, 10 s; with and without gc.freeze
    python3 -m bench.tail --encoding json --rows 16 --concurrency 16

The server runs as in bench.serve (core 0, one torch thread; wrk on core 1) under
bench/gc_probe.py, once as shipped and once with its gc.freeze() disabled. For each run: the
latency percentiles from wrk, the rows per batch from /metrics (p99 of the batch sizes as well as
the mean: outliers would show there), and the collector's passes that fell inside the measured
window, by generation: count, total and longest pause. A pass stops the event loop and every
request in flight waits for it, so a pause of P ms every T s puts P ms on the slowest
C × (request rate × P) requests.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from bench.serve import pinned, request_body, run_wrk, server_env
from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_testing import metric_value, start_server


def batch_buckets(page: str) -> dict[float, float]:
    """ffn_batch_rows' cumulative bucket counts of model `ffn`, by upper bound."""
    buckets = {}
    for line in page.splitlines():
        if line.startswith("ffn_batch_rows_bucket{") and 'model="ffn"' in line:
            buckets[float(line.split('le="')[1].split('"')[0])] = float(line.rsplit(" ", 1)[1])
    return buckets


def batch_quantile(before: str, after: str, q: float) -> float:
    """The upper bucket bound holding quantile q of the batches formed between two /metrics pages."""
    start, end = batch_buckets(before), batch_buckets(after)
    counts = {bound: end[bound] - start.get(bound, 0.0) for bound in sorted(end)}
    total = max(counts.values(), default=0.0)
    return next((bound for bound, count in counts.items() if total and count >= q * total), float("nan"))


def run(folder: Path, args: argparse.Namespace, freeze: bool) -> dict:
    log = folder / f"gc-{freeze}.json"
    env = server_env(0.0, 1024) | {"BENCH_GC_LOG": str(log), "BENCH_GC_FREEZE": "1" if freeze else "0"}
    body, headers = request_body(args.encoding, args.rows, args.d_model, folder)
    with start_server(
        env,
        folder / "ffn.toml",
        prefix=pinned(0),
        command=(sys.executable, "-m", "bench.gc_probe"),
        ready_timeout=120.0,
    ) as server:
        url = f"{server.url}/v1/models/ffn/transform"
        run_wrk(url, body, headers, args.concurrency, 1)  # warm-up
        before = httpx.get(f"{server.url}/metrics").text
        started = time.time()
        result = run_wrk(url, body, headers, args.concurrency, args.seconds)
        ended = time.time()
        after = httpx.get(f"{server.url}/metrics").text
    pauses = [
        (generation, seconds) for at, generation, seconds in json.loads(log.read_text()) if started <= at <= ended
    ]
    gc_rows = {}
    for generation in (0, 1, 2):
        mine = [s * 1000 for g, s in pauses if g == generation]
        gc_rows[generation] = (len(mine), sum(mine), max(mine, default=0.0))
    return {
        "rps": result["requests"] / (result["duration_us"] / 1e6),
        "p50": result["p50_us"] / 1000,
        "p90": result["p90_us"] / 1000,
        "p99": result["p99_us"] / 1000,
        "max": result["max_us"] / 1000,
        "batch_mean": (
            metric_value(after, "ffn_batch_rows_sum", model="ffn")
            - metric_value(before, "ffn_batch_rows_sum", model="ffn")
        )
        / max(
            1.0,
            metric_value(after, "ffn_batch_rows_count", model="ffn")
            - metric_value(before, "ffn_batch_rows_count", model="ffn"),
        ),
        "batch_p99": batch_quantile(before, after, 0.99),
        "gc": gc_rows,
        "seconds": ended - started,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--encoding", default="binary", choices=["binary", "json"])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--d-ff", type=int, default=3072)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = build_ffn(FFNConfig(d_model=args.d_model, d_ff=args.d_ff, activation="gelu")).requires_grad_(False)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_ffn(model, folder / "ffn.safetensors")
        (folder / "ffn.toml").write_text('[[models]]\nname = "ffn"\nweights = "ffn.safetensors"\n')
        runs = {
            "without gc.freeze": run(folder, args, freeze=False),
            "with gc.freeze (shipped)": run(folder, args, True),
        }
    print(
        f"{args.encoding}, r={args.rows}, C={args.concurrency}, {args.seconds:g} s per run; server on core 0, wrk on core 1"
    )
    print()
    print(
        "| run | req/s | p50 ms | p90 ms | p99 ms | max ms | p99/p50 | rows/batch mean | rows/batch p99 "
        "| gen0 passes (longest ms) | gen1 passes (longest ms) | gen2 passes (total ms, longest ms) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        g = r["gc"]
        print(
            f"| {name} | {r['rps']:,.0f} | {r['p50']:.1f} | {r['p90']:.1f} | {r['p99']:.1f} | {r['max']:.1f} "
            f"| {r['p99'] / r['p50']:.1f} | {r['batch_mean']:.1f} | ≤ {r['batch_p99']:g} "
            f"| {g[0][0]} ({g[0][2]:.1f}) | {g[1][0]} ({g[1][2]:.1f}) | {g[2][0]} ({g[2][1]:.0f}, {g[2][2]:.1f}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
