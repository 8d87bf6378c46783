"""What loads of names no [[models]] table names cost a server (issue 28 class 7).

Not run in CI. It starts `python -m app.cli --model-control explicit` (the built-in demo model,
no config file) from `--server-dir` on a free 127.0.0.1 port, then asks for `--loads` loads of
new names, each with `{"parameters": {"config": "{}"}}` (tritonclient's `load_model(name,
config="{}")`), one after the other, and prints what they got: their statuses, the server's
resident memory before and after, the repository index's entries, and the /metrics lines that
name them. Before the models were the configuration's, each such load built a copy of the demo
weights that stayed, listed and in /metrics.

    python3 -m bench.model_loads
    python3 -m bench.model_loads --server-dir /tmp/before --loads 20
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import httpx

from ffn_testing import read_rss, start_server

REPO_ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def measure(server_dir: Path, loads: int) -> str:
    env = {"FFN_WARMUP": "0", "FFN_LOG_LEVEL": "warning"}
    with start_server(env=env, args=["--model-control", "explicit"], cwd=server_dir) as server:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            http.get("/metrics")  # the first scrape's own allocations are not the loads'
            before = read_rss(server.pid)
            started = time.perf_counter()
            statuses = Counter(
                http.post(f"/v2/repository/models/made-up-{i}/load", json={"parameters": {"config": "{}"}}).status_code
                for i in range(loads)
            )
            elapsed = time.perf_counter() - started
            after = read_rss(server.pid)
            index = http.post("/v2/repository/index").json()
            page = http.get("/metrics").text
    named = sum("made-up-" in line for line in page.splitlines())
    answered = ", ".join(f"{status}: {count}" for status, count in sorted(statuses.items()))
    return (
        f"| {loads} loads answered {answered} | {elapsed:.1f} s | +{(after - before) / MiB:.1f} MiB "
        f"| {len(index)} | {named} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-dir", type=Path, default=REPO_ROOT, help="checkout whose app/ is served")
    parser.add_argument("--loads", type=int, default=20, help="loads of new names, one after the other")
    args = parser.parse_args()
    print(f"server: {args.server_dir}")
    print("| what the loads got | their time | RSS growth | index entries | /metrics lines naming them |")
    print("|---|---|---|---|---|")
    print(measure(args.server_dir, args.loads))


if __name__ == "__main__":
    main()
