"""A model reloaded under steady load: failed requests, the latency tail during reloads, where a reload's time goes.

    python3 -m bench.reload                                   # 1 and 2 workers, 60 s, a reload every 5 s, 3 repeats
    python3 -m bench.reload --workers 2 --seconds 10 --repeats 1    # a quick look

One server per worker count serves model `ffn` (d_model 512, d_ff 2048, ReLU: the demo's sizes)
from a weights file in its model repository, with model_control = explicit. The load is
ffn-loadtest's raw HTTP/1.1 sender in a closed loop: 16 keep-alive connections, the native
binary encoding, 16 rows a request. Each repeat runs that load twice: `seconds` without a
reload (the baseline, measured in the same run), then `seconds` during which the weights file
is replaced (a copy renamed over it, as an operator would) and POST .../load called every
`interval` seconds. A request is "during a reload" when its time on the wire overlaps a load's,
from the POST to its answer.

Table 1, medians over the repeats: requests sent and failed in each phase, p50 and p99, and p99
during reloads as a ratio to p99 without (the goal: at most 2). Table 2: each reload's answer
time as the client saw it, and how each worker's time split: read (file to host memory,
checked), build (onto the device, runner and batcher), warm-up, switch (the registry's entry),
then retire (the old copy finishing what it admitted, stopped and freed); the median over every
reload and worker, and the max.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from ffn_client.load import LoadConfig
from ffn_client.payloads import make_payloads
from ffn_client.senders import RawSender
from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_testing import start_server

MODEL = "ffn"
STEPS = ("read", "build", "warm_up", "switch", "retire")


@dataclass
class Phase:
    """One phase's requests: (start, end, status) each, perf_counter seconds."""

    log: list[tuple[float, float, int]]

    def latencies_ms(self, windows: list[tuple[float, float]] | None = None) -> np.ndarray:
        ok = [(s, e) for s, e, status in self.log if status == 200]
        if windows is not None:
            ok = [(s, e) for s, e in ok if any(s < w_end and e > w_start for w_start, w_end in windows)]
        return np.array([(e - s) * 1000 for s, e in ok])

    @property
    def failed(self) -> int:
        return sum(status != 200 for _, _, status in self.log)


@dataclass
class Reload:
    start: float
    end: float
    status: int
    answer: dict[str, Any]


@dataclass
class Repeat:
    baseline: Phase
    reloading: Phase
    reloads: list[Reload] = field(default_factory=list)


def write_weights(path: Path, seed: int, d_model: int, d_ff: int) -> None:
    torch.manual_seed(seed)
    save_ffn(build_ffn(FFNConfig(d_model=d_model, d_ff=d_ff, activation="relu")), path)


def replace_with(source: Path, target: Path) -> None:
    """`source`'s bytes at `target`, put there in one rename (a reader sees the old file or the new one)."""
    beside = target.with_name(f".{target.name}.new")
    shutil.copyfile(source, beside)
    os.replace(beside, target)


async def closed_loop(sender: RawSender, requests: list[bytes], concurrency: int, until: float) -> Phase:
    log: list[tuple[float, float, int]] = []

    async def worker(first: int) -> None:
        i = first
        while (start := time.perf_counter()) < until:
            status = await sender.send(requests[i % len(requests)])
            log.append((start, time.perf_counter(), status))
            i += concurrency

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return Phase(log)


async def reload_every(url: str, sources: list[Path], target: Path, interval: float, until: float) -> list[Reload]:
    reloads: list[Reload] = []
    async with httpx.AsyncClient(timeout=300.0, trust_env=False) as http:
        due = time.perf_counter() + interval / 2
        while due < until:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            # The file is replaced off the loop (the load's clock starts after), as an operator would before loading.
            await asyncio.to_thread(replace_with, sources[len(reloads) % len(sources)], target)
            start = time.perf_counter()
            response = await http.post(f"{url}/v2/repository/models/{MODEL}/load")
            end = time.perf_counter()
            reloads.append(Reload(start, end, response.status_code, response.json()))
            due += interval
    return reloads


async def one_repeat(url: str, args: argparse.Namespace, sources: list[Path], target: Path) -> Repeat:
    config = LoadConfig(url=url, model=MODEL, encoding="binary", rows=(args.rows, args.rows), payloads=16)
    sender = RawSender(url, args.concurrency, 30.0, {})
    try:
        requests = [
            sender.prepare(path, body, headers) for path, body, headers, _ in make_payloads(config, args.d_model)
        ]
        await closed_loop(sender, requests, args.concurrency, time.perf_counter() + 2.0)  # connections opened, warm
        baseline = await closed_loop(sender, requests, args.concurrency, time.perf_counter() + args.seconds)
        until = time.perf_counter() + args.seconds
        reloading, reloads = await asyncio.gather(
            closed_loop(sender, requests, args.concurrency, until),
            reload_every(url, sources, target, args.interval, until),
        )
    finally:
        await sender.aclose()
    return Repeat(baseline, reloading, reloads)


def run_workers(workers: int, args: argparse.Namespace, folder: Path) -> list[Repeat]:
    sources = [folder / f"weights-{seed}.safetensors" for seed in (1, 2)]
    for seed, source in enumerate(sources, start=1):
        write_weights(source, seed, args.d_model, args.d_ff)
    target = folder / "model.safetensors"
    replace_with(sources[1], target)
    config = folder / "ffn.toml"
    config.write_text(
        f"model_control = 'explicit'\nmax_batch_rows = {args.max_batch_rows}\n\n"
        f'[[models]]\nname = "{MODEL}"\nweights = "model.safetensors"\n'
    )
    env = {"FFN_WORKERS": str(workers), "FFN_LOG_LEVEL": "warning"}
    with start_server(env, config, ready_timeout=180.0) as server:
        return [asyncio.run(one_repeat(server.url, args, sources, target)) for _ in range(args.repeats)]


def p(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def load_table(results: dict[int, list[Repeat]]) -> str:
    lines = [
        "| workers | requests | failed | p50 ms | p99 ms | p99 / p99 without reloads |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for workers, repeats in results.items():
        windows = [[(x.start, x.end) for x in r.reloads] for r in repeats]
        rows = [  # (label, the phase of each repeat, the latencies of each repeat)
            ("no reloads", [r.baseline for r in repeats], [r.baseline.latencies_ms() for r in repeats]),
            ("reloading: all", [r.reloading for r in repeats], [r.reloading.latencies_ms() for r in repeats]),
            (
                "reloading: during a load",
                None,
                [r.reloading.latencies_ms(w) for r, w in zip(repeats, windows, strict=True)],
            ),
        ]
        base_p99 = median([p(latencies, 99) for latencies in rows[0][2]])
        for label, phases, latencies in rows:
            p99 = median([p(each, 99) for each in latencies])
            sent = (
                f"{median([float(len(ph.log)) for ph in phases]):.0f}"
                if phases
                else f"{median([float(each.size) for each in latencies]):.0f} answered"
            )
            failed = f"{median([float(ph.failed) for ph in phases]):.0f}" if phases else "-"
            lines.append(
                f"| {workers}, {label} | {sent} | {failed} | {median([p(each, 50) for each in latencies]):.2f} "
                f"| {p99:.2f} | {p99 / base_p99:.2f} |"
            )
    return "\n".join(lines)


def reload_table(results: dict[int, list[Repeat]]) -> str:
    lines = [
        "| workers | reloads | failed | answer ms | to serving ms | read | build | warm-up | switch | retire |",
        "|---:|---:|---:|---|---|---|---|---|---|---|",
    ]
    for workers, repeats in results.items():
        reloads = [x for r in repeats for x in r.reloads]
        done = [x for x in reloads if x.status == 200]
        steps = [w for x in done for w in x.answer["workers"]]

        def cell(values: list[float]) -> str:
            return f"{median(values):.3g} (max {max(values, default=float('nan')):.3g})"

        answer = [(x.end - x.start) * 1000 for x in done]
        to_serving = [sum(w[f"{s}_s"] for s in STEPS[:4]) * 1000 for w in steps]
        split = [cell([w[f"{s}_s"] * 1000 for w in steps]) for s in STEPS]
        lines.append(
            f"| {workers} | {len(reloads)} | {len(reloads) - len(done)} | {cell(answer)} | {cell(to_serving)} | "
            + " | ".join(split)
            + " |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts (default 1 2)")
    p.add_argument("--seconds", type=float, default=60.0, help="each phase's length (default 60)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between reloads (default 5)")
    p.add_argument("--repeats", type=int, default=3, help="baseline + reload phases per worker count (default 3)")
    p.add_argument("--concurrency", type=int, default=16, help="connections (default 16)")
    p.add_argument("--rows", type=int, default=16, help="rows per request (default 16)")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-ff", type=int, default=2048)
    p.add_argument("--max-batch-rows", type=int, default=1024)
    p.add_argument("--json", type=Path, help="also write every request's and reload's figures here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results: dict[int, list[Repeat]] = {}
    for workers in args.workers:
        with tempfile.TemporaryDirectory(prefix="bench-reload-") as folder:
            results[workers] = run_workers(workers, args, Path(folder))
    print(
        f"reload under load: {args.concurrency} connections, native binary, r={args.rows}, d_model {args.d_model}, "
        f"d_ff {args.d_ff}; {args.seconds:g} s per phase, a reload every {args.interval:g} s; "
        f"medians of {args.repeats} repeat(s); {os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print()
    print(load_table(results))
    print()
    print(reload_table(results))
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    str(workers): [
                        {
                            "baseline": r.baseline.log,
                            "reloading": r.reloading.log,
                            "reloads": [x.__dict__ for x in r.reloads],
                        }
                        for r in repeats
                    ]
                    for workers, repeats in results.items()
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
