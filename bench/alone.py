"""One request alone on the CPU: where its time goes, in one run.

    python3 -m bench.alone                          # 768/3072 GELU float32, 3 rounds of 3 s
    python3 -m bench.alone --rounds 5 --seconds 5 --d-model 512 --d-ff 2048

One client (wrk, one connection, pinned to core 1) sends one row at a time as binary to a server
pinned to core 0 with one torch thread. Each round measures, in turn:

- the model called in-process on core 0, back to back (its weights stay in the cache), and with a
  64 MiB buffer rewritten between calls (its weights evicted, as a request's other work does);
- the server as configured (`inline_forward_us` 500: this pass runs on the model thread);
- the server with `inline_forward_us` at its maximum (the pass runs on the event loop's thread,
  sparing the two hand-offs between threads).

For each server it prints wrk's p50, and the server's own means over the same requests:
`ffn_http_request_seconds` (the whole request, read to written), `ffn_request_seconds` (queued
and computed) and `ffn_compute_seconds` (from handing the batch to the model to having its
answer back on the loop). The medians of the rounds are reported; the rounds alternate so that
a busy machine slows every line alike. Needs wrk (Debian package wrk) and Linux.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import torch

from bench.serve import SERVER_CORE, pinned, request_body, run_wrk, server_env
from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_testing import metric_value, start_server

EVICTION_BYTES = 64 << 20  # past the L3 cache of any machine this runs on
ROUTE = "/v1/models/{name}/transform"
SERVERS = {"model thread": "500", "inline": "100000"}  # inline_forward_us


def in_process_ms(model: torch.nn.Module, x: torch.Tensor, calls: int, between: Callable[[], None] | None) -> float:
    """p50 of `calls` forward passes on SERVER_CORE, `between` run before each (untimed)."""
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {SERVER_CORE})
    try:
        times = []
        with torch.inference_mode():
            for _ in range(max(10, calls // 10)):
                model(x)
            for _ in range(calls):
                if between is not None:
                    between()
                start = time.perf_counter()
                model(x)
                times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)
    finally:
        os.sched_setaffinity(0, previous)


def server_means(url: str) -> dict[str, float]:
    """The sums and counts of the three timings, from /metrics."""
    page = httpx.get(f"{url}/metrics", timeout=30).text
    means = {}
    for name, labels in (
        ("ffn_http_request_seconds", {"route": ROUTE, "status": "2xx"}),
        ("ffn_request_seconds", {"model": "ffn"}),
        ("ffn_compute_seconds", {"model": "ffn"}),
    ):
        means[f"{name}_sum"] = metric_value(page, f"{name}_sum", **labels)
        means[f"{name}_count"] = metric_value(page, f"{name}_count", **labels)
    return means


def measure_server(config: Path, folder: Path, d_model: int, inline_us: str, seconds: float) -> dict[str, float]:
    """wrk's p50 and the server's mean timings (ms) over `seconds` of one client, one row."""
    env = server_env(0.0, 1024) | {"FFN_INLINE_FORWARD_US": inline_us}
    with start_server(env, config, prefix=pinned(SERVER_CORE), ready_timeout=120.0) as server:
        url = f"{server.url}/v1/models/ffn/transform"
        body, headers = request_body("binary", 1, d_model, folder)
        run_wrk(url, body, headers, 1, 1)  # warm-up
        before = server_means(server.url)
        result = run_wrk(url, body, headers, 1, seconds)
        after = server_means(server.url)
    if result["status_errors"] or result["socket_errors"]:
        raise RuntimeError(f"wrk saw errors: {result}")
    timings = {"client p50": result["p50_us"] / 1000}
    for name, label in (
        ("ffn_http_request_seconds", "server: whole request"),
        ("ffn_request_seconds", "server: queued and computed"),
        ("ffn_compute_seconds", "server: compute"),
    ):
        count = after[f"{name}_count"] - before[f"{name}_count"]
        timings[label] = 1000 * (after[f"{name}_sum"] - before[f"{name}_sum"]) / count
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--d-ff", type=int, default=3072)
    parser.add_argument("--activation", default="gelu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="of wrk per server and round")
    parser.add_argument("--calls", type=int, default=300, help="in-process calls per timing")
    args = parser.parse_args(argv)
    if not shutil.which("wrk"):
        print("bench.alone needs wrk (apt-get install wrk)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = build_ffn(FFNConfig(args.d_model, args.d_ff, args.activation)).requires_grad_(False)
    x = torch.randn(1, args.d_model)
    junk = np.ones(EVICTION_BYTES // 8)

    def evict() -> None:
        junk.__iadd__(1.0)

    in_process: dict[str, list[float]] = {}
    served: dict[str, dict[str, list[float]]] = {server: {} for server in SERVERS}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_ffn(model, folder / "ffn.safetensors")
        config = folder / "ffn.toml"
        config.write_text('[[models]]\nname = "ffn"\nweights = "ffn.safetensors"\n')
        for round_ in range(args.rounds):
            in_process.setdefault("weights in cache", []).append(in_process_ms(model, x, args.calls, None))
            in_process.setdefault("weights evicted", []).append(in_process_ms(model, x, args.calls, evict))
            for server, inline_us in SERVERS.items():
                for label, ms in measure_server(config, folder, args.d_model, inline_us, args.seconds).items():
                    served[server].setdefault(label, []).append(ms)
            print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    print(f"One request alone: {args.d_model}/{args.d_ff} {args.activation} float32, one row, binary, one client;")
    print(f"medians of {args.rounds} rounds, ms (the range in brackets)")
    print()
    print("| the model in-process | ms |")
    print("|---|---|")
    for label, values in in_process.items():
        print(f"| {label} | {_cell(values)} |")
    print()
    print(f"| the server | {' | '.join(SERVERS)} |")
    print(f"|---|{'---|' * len(SERVERS)}")
    for label in served["model thread"]:
        print(f"| {label} | {' | '.join(_cell(served[server][label]) for server in SERVERS)} |")
    return 0


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


if __name__ == "__main__":
    sys.exit(main())
