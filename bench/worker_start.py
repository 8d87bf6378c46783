"""What starting worker processes costs: CPU to ready, memory once serving, and a replacement's start.

    python3 -m bench.worker_start                          # 1, 2 and 4 workers, 3 repeats
    python3 -m bench.worker_start --workers 2 --repeats 1  # a quick look

Each repeat starts `python -m app.cli` on the built-in demo model with FFN_WORKERS=N (one torch
thread each), waits until the supervisor logs that every worker is ready, and reads from /proc:
the CPU seconds its whole process tree spent getting there (the supervisor, the fork server its
workers are forked from, the workers), and, after 50 requests, each process's proportional set
size (PSS: a page shared by k processes counts 1/k to each, so the sum is what the tree costs the
machine) and the workers' private dirty memory. Then one worker is SIGKILLed, and the CPU its
replacement spent until the supervisor logs it ready is read.

The reference, measured in the same run: the CPU a fresh interpreter spends importing what a worker
imports before it can load a model (`import app.process.server, app.engine.service`), which every worker
paid when each was spawned anew. Medians over the repeats.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from ffn_testing import ServerProcess, process_tree, start_server, tree_cpu_seconds

READY = re.compile(r"worker \d+ \(pid (\d+)\) ready")
WORKER_IMPORTS = "import app.process.server, app.engine.service"


@dataclass
class Reading:
    ready_s: float
    cpu_s: float  # the tree's, from start to every worker ready
    pss_mib: float  # the tree's, serving
    private_dirty_mib: float  # each worker's, median
    replacement_cpu_s: float  # a replaced worker's, to ready (nan for one worker: no supervisor)


def memory_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no {field} in /proc/{pid}/smaps_rollup")


def fresh_import_cpu_s() -> float:
    """CPU seconds a fresh interpreter spends on a worker's imports (the spawned worker's cost)."""
    before = os.times()
    subprocess.run([sys.executable, "-c", WORKER_IMPORTS], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    after = os.times()
    return (after.children_user - before.children_user) + (after.children_system - before.children_system)


def wait_for(condition: Callable[[], bool], what: str, server: ServerProcess, limit_s: float = 180.0) -> None:
    give_up = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > give_up or server.proc.poll() is not None:
            raise SystemExit(f"{what}: not within {limit_s:.0f} s\n{server.logs()}")
        time.sleep(0.02)


def measure(workers: int) -> Reading:
    env = {"FFN_WORKERS": str(workers), "OMP_NUM_THREADS": "1", "FFN_TORCH_THREADS": "1"}
    began = time.monotonic()
    with start_server(env=env) as server:
        if workers > 1:
            wait_for(lambda: f"ready: {workers} workers" in server.logs(), "every worker ready", server)
        ready_s = time.monotonic() - began
        spent = tree_cpu_seconds(server.pid) or 0.0
        x = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
        body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
        for _ in range(50):  # new connections: each worker serves some
            response = httpx.post(f"{server.url}/v2/models/demo/infer", json=body, headers={"Connection": "close"})
            response.raise_for_status()
        serving = process_tree(server.pid)
        pss = sum(memory_mib(pid, "Pss") for pid in serving)
        worker_pids = server.worker_pids() if workers > 1 else {server.pid}
        dirty = statistics.median(memory_mib(pid, "Private_Dirty") for pid in worker_pids)
        replacement = float("nan")
        if workers > 1:
            victim = min(worker_pids)
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda: len(server.worker_pids() - worker_pids) == 1, "a replacement started", server)
            (newcomer,) = server.worker_pids() - worker_pids
            wait_for(lambda: str(newcomer) in READY.findall(server.logs()), "the replacement ready", server)
            replacement = tree_cpu_seconds(newcomer) or 0.0
    return Reading(ready_s, spent, pss, dirty, replacement)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    fresh = statistics.median(fresh_import_cpu_s() for _ in range(args.repeats))
    print(f"a fresh interpreter's `{WORKER_IMPORTS}`: {fresh:.2f} CPU s (median of {args.repeats})\n")
    print(
        "| workers | ready s | CPU s to ready (tree) | replacement's CPU s | ÷ fresh import | PSS MiB (tree) | private dirty MiB per worker |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for workers in args.workers:
        readings = [measure(workers) for _ in range(args.repeats)]

        def median(name: str, readings: list[Reading] = readings) -> float:
            return statistics.median(getattr(reading, name) for reading in readings)

        replacement = median("replacement_cpu_s")
        print(
            f"| {workers} | {median('ready_s'):.1f} | {median('cpu_s'):.2f} | "
            + ("–" if np.isnan(replacement) else f"{replacement:.2f}")
            + " | "
            + ("–" if np.isnan(replacement) else f"{replacement / fresh:.2f}")
            + f" | {median('pss_mib'):.0f} | {median('private_dirty_mib'):.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
