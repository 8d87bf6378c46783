"""The service against an echo server on the same HTTP stack: how much of its own transport it carries.

    python -m bench.transport                        # the full table, about 8 minutes
    python -m bench.transport --quick                # every part in miniature, well under a minute
    python -m bench.transport --profile              # and where a request's CPU goes, stage by stage (py-spy)
    python -m bench.transport --against ../before    # another checkout's service in the same run
    python -m bench.transport --shared-engine        # also one front and one engine process (issue 30)
                                                     # (with --against, the other checkout's too)
    python -m bench.transport --tls                  # also the echo and each model over HTTPS (issue 42)

In front of a GPU the FFN costs microseconds, so what limits the service there is everything
around the model. That is measured here on the CPU: ffn-serve with a near-free model (d_model
768, d_ff 8) and with the real one (768/3072, GELU, float32), beside `bench/gpu/echo.py` (each
body answered with itself) on the same stack (uvicorn, uvloop, httptools), plain and under
ffn-serve's own protocol (app/http/transport/protocol.py: its budgets and timers, the hardening's cost
alone). Each server runs on the server core with one torch thread, the load generator (wrk,
or ffn-loadtest where wrk is missing) on the client core; binary float32 requests of r rows
over C connections, closed loop. Every cell runs `--repeat` times, the servers in turn within
each round (so that the host's drifts hit all of them), and the table gives the medians.

Per cell: rows/s, bytes/s (request and answer bodies), p50 and p99 latency, the server's CPU
time per request (its whole process tree, from /proc, over the measured window), and for
ffn-serve the mean rows per batch (from /metrics) and the model's own CPU per request at that
batch (timed in-process on the server core). The goals of issue 21 are printed as met or
missed, and the GPU prediction: rows/s per worker when the model costs nothing, from the
near-free model's CPU per request less the model's own share.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench import stages
from bench.gpu import service
from bench.micro import measure_rows_per_s
from bench.serve import pinned, server_env
from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_testing import ServerProcess, start_server

REPO_ROOT = Path(__file__).resolve().parent.parent
D_MODEL = 768
MODELS = {"near-free": 8, "real": 3072}  # d_ff
ECHOES = ("echo", "echo+protocol")  # plain uvicorn; uvicorn under ffn-serve's protocol


@dataclass(frozen=True)
class Server:
    """One server to measure: an echo, or ffn-serve with a model from a checkout."""

    name: str  # the table's column: "echo", "echo+protocol", "near-free", "real", "near-free@other", ...
    model: str | None = None  # a MODELS key for ffn-serve
    checkout: Path = REPO_ROOT
    shared_engine: bool = False  # one front and one engine process (FFN_SHARED_ENGINE) instead of one process
    tls: bool = False  # HTTPS (a certificate the run makes); its column ends in "+tls", compared with "echo+tls"


@dataclass
class Cell:
    """The medians of one server's repeats at r rows and C connections."""

    server: str
    rows: int
    concurrency: int
    repeats: int
    rows_per_s: float
    bytes_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_ms_per_request: float
    errors: int
    mean_batch_rows: float  # NaN for an echo
    model_ms_per_request: float  # the model's own CPU at that batch, in-process; NaN for an echo


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.transport", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="r 1 and 16, C 1 and 4, one round of 0.25 s: proves it runs")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256], help="rows per request")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64], help="connections")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument(
        "--seconds",
        type=float,
        default=2.0,
        help="measured seconds per cell, after a warm-up of 1 s (or as long as the cell, if shorter)",
    )
    p.add_argument("--repeat", type=int, default=3, help="rounds; the table gives each cell's median")
    p.add_argument("--server-cpus", default="0", help="cores of the servers (taskset list)")
    p.add_argument("--client-cpus", default="1", help="cores of the load generator and py-spy")
    p.add_argument("--generator", choices=["auto", "wrk", "ffn-loadtest"], default="auto")
    p.add_argument("--against", type=Path, help="another checkout: its service is measured too, in turn")
    p.add_argument(
        "--shared-engine",
        action="store_true",
        help="each model also as one front and one engine process (MODEL+engine), in turn with the single process",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="also the echo and each model over HTTPS (MODEL+tls, echo+tls), each +tls row compared with echo+tls",
    )
    p.add_argument("--profile", action="store_true", help="py-spy: the near-free model's CPU by stage")
    p.add_argument(
        "--profile-cells",
        default="1x16,256x16",
        help="r x C cells to profile, comma-separated (default 1x16,256x16)",
    )
    p.add_argument("--json", type=Path, help="write the cells (and the profile) here")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.concurrency, args.seconds, args.repeat = [1, 16], [1, 4], 0.25, 1
        args.profile_cells = "16x4"
    if args.generator == "auto":
        args.generator = "wrk" if shutil.which("wrk") else "ffn-loadtest"
    return args


def cores(spec: str) -> list[int]:
    return [int(core) for core in spec.split(",")]


@contextlib.contextmanager
def running(
    server: Server, configs: dict[str, Path], server_cores: list[int], tls: service.BenchTls | None = None
) -> Iterator[ServerProcess]:
    """The server started, pinned to the server cores, and ready; stopped after the block. `tls`: for a +tls server."""
    prefix = pinned(",".join(map(str, server_cores)))
    served_tls = tls if server.tls else None
    if server.name in ("echo", "echo+tls"):
        with service.serving("echo", 1, server_cores, configs["near-free"], 1, served_tls) as process:
            yield process
    elif server.name == "echo+protocol":
        command = [sys.executable, "-m", "bench.protocol_echo"]
        with start_server({}, None, prefix=prefix, command=command, cwd=REPO_ROOT, ready_timeout=120.0) as process:
            yield process
    else:
        assert server.model is not None, "an ffn-serve server without a model; this is a bug."
        env = server_env(max_wait_ms=0.0, max_batch_rows=1024) | {"FFN_LOG_LEVEL": "warning"}
        if server.shared_engine:  # the supervisor, one front and the engine, all on the server cores
            env |= {"FFN_SHARED_ENGINE": "true"}
        if served_tls is not None:
            env |= served_tls.env()
        with start_server(
            env,
            configs[server.model],
            prefix=prefix,
            cwd=server.checkout,
            ready_timeout=300.0,
            verify=None if served_tls is None else served_tls.ca,
        ) as process:
            yield process


def measure(
    servers: list[Server], configs: dict[str, Path], args: argparse.Namespace, folder: Path
) -> dict[tuple[str, int, int], list[service.ServiceCell]]:
    """Every server at every cell, `args.repeat` rounds, the servers in turn within a round."""
    server_cores, client_cores = cores(args.server_cpus), cores(args.client_cpus)
    found: dict[tuple[str, int, int], list[service.ServiceCell]] = {}
    tls = service.BenchTls.made_in(folder) if any(server.tls for server in servers) else None
    for round_ in range(args.repeat):
        for server in servers:
            kind = "ffn" if server.model else "echo"
            with running(server, configs, server_cores, tls) as process:
                for rows in args.rows:
                    for concurrency in args.concurrency:
                        cell = service.measure_cell(
                            kind,
                            process,
                            1,
                            rows,
                            concurrency,
                            args.seconds,
                            D_MODEL,
                            folder,
                            client_cores,
                            args.generator,
                            tls.ca if tls is not None and server.tls else None,
                        )
                        found.setdefault((server.name, rows, concurrency), []).append(cell)
                        print(
                            f"round {round_ + 1}/{args.repeat} {server.name:>16} r={rows:<4} C={concurrency:<3} "
                            f"{cell.rows_per_s:>10,.0f} rows/s {cell.bytes_per_s / 1e6:>8,.1f} MB/s "
                            f"p50 {cell.p50_ms:7.3f} ms p99 {cell.p99_ms:8.3f} ms "
                            f"cpu {cell.server_cpu_ms_per_request:.3f} ms/req errors {cell.errors}",
                            flush=True,
                        )
    return found


class ModelCost:
    """The served model's own CPU time per row at a batch size, in-process on the server core, one thread."""

    def __init__(self, models: dict[str, torch.nn.Module], server_cores: list[int], seconds: float) -> None:
        self.models, self.cores, self.seconds = models, set(server_cores), seconds
        self.cache: dict[tuple[str, int], float] = {}

    def ms_per_row(self, model: str, batch_rows: float) -> float:
        rows = max(1, round(batch_rows))
        key = (model, rows)
        if key not in self.cache:
            previous = os.sched_getaffinity(0)
            os.sched_setaffinity(0, self.cores)
            try:
                best = max(
                    measure_rows_per_s(self.models[model], rows, torch.float32, 1, self.seconds) for _ in range(3)
                )
            finally:
                os.sched_setaffinity(0, previous)
            self.cache[key] = 1000.0 / best
        return self.cache[key]


def summarise(
    found: dict[tuple[str, int, int], list[service.ServiceCell]], servers: list[Server], cost: ModelCost
) -> list[Cell]:
    cells = []
    for (name, rows, concurrency), runs in found.items():
        model = next(s.model for s in servers if s.name == name)
        batch = statistics.median(c.mean_batch_rows for c in runs) if model else math.nan
        cells.append(
            Cell(
                name,
                rows,
                concurrency,
                len(runs),
                statistics.median(c.rows_per_s for c in runs),
                statistics.median(c.bytes_per_s for c in runs),
                statistics.median(c.p50_ms for c in runs),
                statistics.median(c.p99_ms for c in runs),
                statistics.median(c.server_cpu_ms_per_request for c in runs),
                sum(c.errors for c in runs),
                batch,
                cost.ms_per_row(model, batch) * rows if model and not math.isnan(batch) else math.nan,
            )
        )
    return cells


def table(cells: list[Cell], servers: list[Server]) -> str:
    """One row per (r, C) and server, with the ratios against the echo in the same row: the plain echo,
    or for a +tls server the echo over HTTPS."""
    echoes = {(c.server, c.rows, c.concurrency): c for c in cells if c.server in ("echo", "echo+tls")}
    lines = [
        "| r | C | server | rows/s | MB/s | of echo | p50 ms | p50 − echo | p99 ms | CPU ms/req | × echo "
        "| rows/batch | model ms/req |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {s.name: i for i, s in enumerate(servers)}
    for c in sorted(cells, key=lambda c: (c.rows, c.concurrency, order[c.server])):
        e = echoes.get(("echo+tls" if c.server.endswith("+tls") else "echo", c.rows, c.concurrency))
        ratio = f"{c.bytes_per_s / e.bytes_per_s:.0%}" if e and e.bytes_per_s else "-"
        extra = f"{c.p50_ms - e.p50_ms:+.2f}" if e else "-"
        times = f"{c.cpu_ms_per_request / e.cpu_ms_per_request:.1f}" if e and e.cpu_ms_per_request else "-"
        batch = "-" if math.isnan(c.mean_batch_rows) else f"{c.mean_batch_rows:.1f}"
        model = "-" if math.isnan(c.model_ms_per_request) else f"{c.model_ms_per_request:.3f}"
        errors = f" ({c.errors} errors)" if c.errors else ""
        lines.append(
            f"| {c.rows} | {c.concurrency} | {c.server}{errors} | {c.rows_per_s:,.0f} | {c.bytes_per_s / 1e6:,.1f} "
            f"| {ratio} | {c.p50_ms:.2f} | {extra} | {c.p99_ms:.2f} | {c.cpu_ms_per_request:.3f} | {times} "
            f"| {batch} | {model} |"
        )
    return "\n".join(lines)


@dataclass
class Goal:
    goal: str
    measured: str
    met: bool | None  # None: a cell it needs was not measured


def goals(cells: list[Cell], server: str = "near-free") -> list[Goal]:
    """Issue 21's goals for the near-free model on one core, against the plain echo."""
    by = {(c.server, c.rows, c.concurrency): c for c in cells}

    def pair(rows: int, concurrency: int) -> tuple[Cell, Cell] | None:
        ours, echo = by.get((server, rows, concurrency)), by.get(("echo", rows, concurrency))
        return (ours, echo) if ours and echo else None

    found = []
    for rows, concurrency, share, what in ((256, 16, 0.70, "bytes/s"), (16, 16, 0.50, "rows/s")):
        cells_ = pair(rows, concurrency)
        ratio = cells_[0].bytes_per_s / cells_[1].bytes_per_s if cells_ else math.nan
        found.append(
            Goal(
                f"r={rows}, C={concurrency}: ≥ {share:.0%} of echo's {what}",
                f"{ratio:.0%}" if cells_ else "not measured",
                ratio >= share if cells_ else None,
            )
        )
    cells_ = pair(1, 1)
    found.append(
        Goal(
            "r=1, C=1: p50 within 0.5 ms of echo's",
            f"{cells_[0].p50_ms:.2f} vs {cells_[1].p50_ms:.2f} ms ({cells_[0].p50_ms - cells_[1].p50_ms:+.2f})"
            if cells_
            else "not measured",
            cells_[0].p50_ms - cells_[1].p50_ms <= 0.5 if cells_ else None,
        )
    )
    for concurrency in sorted({c.concurrency for c in cells if c.rows == 1}):
        cells_ = pair(1, concurrency)
        if cells_:
            times = cells_[0].cpu_ms_per_request / cells_[1].cpu_ms_per_request
            found.append(
                Goal(
                    f"r=1, C={concurrency}: server CPU per request ≤ 3× echo's",
                    f"{cells_[0].cpu_ms_per_request:.3f} vs {cells_[1].cpu_ms_per_request:.3f} ms ({times:.1f}×)",
                    times <= 3.0,
                )
            )
    return found


def tls_cost(cells: list[Cell]) -> list[str]:
    """What HTTPS adds per request, in server CPU and p50, to the echo and to each model, at each (r, C)."""
    by = {(c.server, c.rows, c.concurrency): c for c in cells}
    lines = [
        "| r | C | server | CPU ms/req, HTTP | HTTPS | TLS adds | p50 ms, HTTP | HTTPS | rows/s, HTTPS of HTTP |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in sorted((c for c in cells if c.server.endswith("+tls")), key=lambda c: (c.rows, c.concurrency, c.server)):
        plain = by.get((c.server.removesuffix("+tls"), c.rows, c.concurrency))
        if plain is None:
            continue
        lines.append(
            f"| {c.rows} | {c.concurrency} | {plain.server} | {plain.cpu_ms_per_request:.3f} "
            f"| {c.cpu_ms_per_request:.3f} | {c.cpu_ms_per_request - plain.cpu_ms_per_request:+.3f} "
            f"| {plain.p50_ms:.2f} | {c.p50_ms:.2f} | {c.rows_per_s / plain.rows_per_s:.0%} |"
        )
    return lines


def prediction(cells: list[Cell], server: str = "near-free") -> list[str]:
    """rows/s per worker (one core) with a model that costs nothing: r / (CPU per request − the model's share)."""
    lines = [
        "| r | best C | measured rows/s | CPU ms/req | model ms/req | predicted rows/s per worker, model free |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for rows in sorted({c.rows for c in cells if c.server == server}):
        best = max((c for c in cells if c.server == server and c.rows == rows), key=lambda c: c.rows_per_s)
        left = best.cpu_ms_per_request - (0.0 if math.isnan(best.model_ms_per_request) else best.model_ms_per_request)
        predicted = rows * 1000.0 / left if left > 0 else math.nan
        lines.append(
            f"| {rows} | {best.concurrency} | {best.rows_per_s:,.0f} | {best.cpu_ms_per_request:.3f} "
            f"| {best.model_ms_per_request:.3f} | {predicted:,.0f} |"
        )
    return lines


def profile(
    servers: list[Server], configs: dict[str, Path], args: argparse.Namespace, folder: Path
) -> dict[str, dict[str, tuple[float, float]]]:
    """py-spy over a steady load of each profiled cell, for the near-free service and the plain echo, and
    with --shared-engine for the layout's front and engine process, each profiled on its own."""
    server_cores, client_cores = cores(args.server_cpus), cores(args.client_cpus)
    results: dict[str, dict[str, tuple[float, float]]] = {}
    for spec in args.profile_cells.split(","):
        rows, concurrency = (int(part) for part in spec.lower().split("x"))
        for server in (s for s in servers if s.name in ("echo", "near-free", "near-free+engine")):
            with running(server, configs, server_cores) as process:
                body, headers, _ = service.prepared_body(rows, D_MODEL, folder)
                service.load(args.generator, process.url, body, headers, rows, D_MODEL, concurrency, 1.0, client_cores)
                parts = layout_parts(server.name, process)
                before = {name: service.tree_cpu_seconds(pid) for name, pid in parts.items()}
                recordings = {
                    name: stages.record(pid, args.seconds * 2, pinned(args.client_cpus)) for name, pid in parts.items()
                }
                result = service.load(
                    args.generator,
                    process.url,
                    body,
                    headers,
                    rows,
                    D_MODEL,
                    concurrency,
                    args.seconds * 2,
                    client_cores,
                )
                for name, pid in parts.items():
                    cpu_ms = 1000.0 * (service.tree_cpu_seconds(pid) - before[name]) / max(result.requests, 1)
                    samples = stages.classify(recordings[name].finish())
                    key = f"{name} r={rows} C={concurrency}"
                    results[key] = stages.breakdown(samples, cpu_ms)
                    print(
                        f"profiled {key}: {sum(samples.values())} samples, {cpu_ms:.3f} ms CPU per request", flush=True
                    )
    return results


def layout_parts(name: str, process: ServerProcess) -> dict[str, int]:
    """The processes to profile, by the name their column gets: the server's own (its tree's CPU), or,
    for the shared-engine layout, its front and its engine (told apart by libtorch, mapped by the engine
    alone), each with its own CPU."""
    if not name.endswith("+engine"):
        return {name: process.pid}
    pids = process.worker_pids()
    engines = [pid for pid in pids if "libtorch" in Path(f"/proc/{pid}/maps").read_text()]
    fronts = [pid for pid in pids if pid not in engines]
    assert len(engines) == 1 and len(fronts) == 1, f"one front and one engine expected: {pids}"
    return {f"{name} (front)": fronts[0], f"{name} (engine)": engines[0]}


def profile_table(results: dict[str, dict[str, tuple[float, float]]]) -> str:
    keys = list(results)
    lines = [
        "| stage | " + " | ".join(f"{key}: µs/req (share)" for key in keys) + " |",
        "|---|" + "---:|" * len(keys),
    ]
    for stage in stages.ORDER:
        if not any(stage in results[key] for key in keys):
            continue
        row = []
        for key in keys:
            share, micros = results[key].get(stage, (0.0, 0.0))
            row.append(f"{micros:,.1f} ({share:.0%})" if share else "-")
        lines.append(f"| {stage} | " + " | ".join(row) + " |")
    totals = [f"{sum(m for _, m in results[key].values()):,.1f}" for key in keys]
    lines.append("| **all (the measured CPU per request)** | " + " | ".join(totals) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_average = os.getloadavg()[0]
    models = {}
    servers = [Server("echo"), Server("echo+protocol")]
    if args.tls:
        servers.append(Server("echo+tls", tls=True))
    for name in args.models:
        torch.manual_seed(0)
        models[name] = build_ffn(FFNConfig(D_MODEL, MODELS[name], "gelu")).requires_grad_(False)
        servers.append(Server(name, name))
        if args.tls:
            servers.append(Server(f"{name}+tls", name, tls=True))
        if args.shared_engine:
            servers.append(Server(f"{name}+engine", name, shared_engine=True))
        if args.against:
            servers.append(Server(f"{name}@other", name, args.against.resolve()))
            if args.shared_engine:  # the layout's own path (the hand-off) against the other checkout's too
                servers.append(Server(f"{name}+engine@other", name, args.against.resolve(), shared_engine=True))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        configs = {}
        for name, model in models.items():
            save_ffn(model, folder / f"{name}.safetensors")
            configs[name] = folder / f"{name}.toml"
            configs[name].write_text(f'[[models]]\nname = "{service.MODEL}"\nweights = "{name}.safetensors"\n')
        configs.setdefault("near-free", next(iter(configs.values())))
        found = measure(servers, configs, args, folder)
        cost = ModelCost(models, cores(args.server_cpus), seconds=0.1 if args.quick else 0.3)
        cells = summarise(found, servers, cost)
        profiled = profile(servers, configs, args, folder) if args.profile else {}
    header = (
        f"ffn-serve against echo: binary float32, d_model {D_MODEL}; models {', '.join(args.models)} "
        f"({', '.join(f'd_ff {MODELS[m]}' for m in args.models)}, GELU, float32); servers on cores "
        f"{args.server_cpus} (1 torch thread), {args.generator} on cores {args.client_cpus}; "
        f"{args.seconds:g} s per cell after {service.warm_up_seconds(args.seconds):g} s of warm-up, median of {args.repeat}; "
        f"1-min load average {load_average:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
    )
    print()
    print(header)
    print()
    print(table(cells, servers))
    found_goals = goals(cells) if "near-free" in args.models else []
    if found_goals:
        print()
        print("| goal (near-free model, one core) | measured | |")
        print("|---|---|---|")
        for g in found_goals:
            print(f"| {g.goal} | {g.measured} | {'-' if g.met is None else 'met' if g.met else 'missed'} |")
        print()
        print("\n".join(prediction(cells)))
    if args.tls:
        print()
        print("\n".join(tls_cost(cells)))
    if profiled:
        print()
        print(profile_table(profiled))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "header": header,
                    "cells": [asdict(c) for c in cells],
                    "goals": [asdict(g) for g in found_goals],
                    "profile": profiled,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
