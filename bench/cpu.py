"""Server CPU time per request, and the same for another checkout in the same run (an A/B).

    python3 -m bench.cpu                                   # this checkout, the demo model
    git worktree add /tmp/before <commit>
    python3 -m bench.cpu --against /tmp/before --repeat 2  # alternating runs, old and new

Latency on a shared virtual machine moves with its neighbours; the server's own CPU time per
request (utime + stime of the server and its children from /proc over a fixed wrk run) moves much less, and the two
checkouts are measured alternately so that drifts hit both. The server is pinned to core 0
with one torch thread, wrk to core 1; binary requests of r rows to the built-in demo model.
The other checkout runs with this interpreter (`python -m app.cli` in its folder).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.gpu.service import tree_cpu_seconds
from bench.serve import pinned, request_body, run_wrk, server_env
from ffn_testing import start_server

REPO_ROOT = Path(__file__).resolve().parent.parent
CELLS = ((1, 1), (1, 64), (16, 16))  # (rows per request, connections)


def measure(checkout: Path, rows: int, connections: int, seconds: float, folder: Path) -> dict[str, float]:
    """requests/s, server CPU ms per request, p50 and p99 ms for one cell against one checkout."""
    body, headers = request_body("binary", rows, 512, folder)
    env = server_env(max_wait_ms=0.0, max_batch_rows=1024) | {"FFN_LOG_LEVEL": "warning"}
    with start_server(env=env, prefix=pinned(0), cwd=checkout) as server:
        url = f"{server.url}/v1/models/demo/transform"
        run_wrk(url, body, headers, connections, 2)  # warm-up
        before = tree_cpu_seconds(server.pid)
        result = run_wrk(url, body, headers, connections, seconds)
        used = tree_cpu_seconds(server.pid) - before
    requests = result["requests"]
    return {
        "requests_per_s": requests / (result["duration_us"] / 1e6),
        "cpu_ms_per_request": 1000 * used / requests,
        "p50_ms": result["p50_us"] / 1000,
        "p99_ms": result["p99_us"] / 1000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, help="another checkout to measure in the same run")
    parser.add_argument("--repeat", type=int, default=1, help="rounds; each round measures every checkout once")
    parser.add_argument("--seconds", type=float, default=8.0, help="wrk duration per cell")
    args = parser.parse_args(argv)
    checkouts = {"this": REPO_ROOT} | ({"other": args.against.resolve()} if args.against else {})
    print("| checkout | r | C | req/s | server CPU ms/request | p50 ms | p99 ms | p99/p50 |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeat):
            for rows, connections in CELLS:
                for name, checkout in checkouts.items():
                    m = measure(checkout, rows, connections, args.seconds, Path(tmp))
                    print(
                        f"| {name} | {rows} | {connections} | {m['requests_per_s']:,.0f} | "
                        f"{m['cpu_ms_per_request']:.3f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | "
                        f"{m['p99_ms'] / m['p50_ms']:.1f} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
