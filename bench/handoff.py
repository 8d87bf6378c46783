"""The hand-off's cost per request (app/handoff): an engine process serving a front, against the
same engine called in-process, in one run.

    python3 -m bench.handoff                 # near-free model (768/8), r=1, C in {1, 64}, 3 rounds of 3 s
    python3 -m bench.handoff --rounds 5 --seconds 5 --rows 1 16 --concurrency 1 16 64
    python3 -m bench.handoff --quick         # every part in miniature

In-process: C tasks of this process, pinned to core 0, call the model's `infer` (the engine
facade's call, with its batcher) back to back. Hand-off: an engine process (`python -m
app.process.engine_process`) pinned to core 0 serves the same model, and this process, pinned to
core 1, is the front: C tasks call `EngineClient.infer`. Each cell reports requests/s and CPU
per request: this process's in-process, and with the hand-off the engine process's (its
/proc/<pid>/stat times over the measured window) and the front's. The engine's CPU per request
less the in-process CPU per request is what the hand-off adds on the engine's side; issue 30 asks
for at most 20 µs at r=1, C=64. Rounds alternate the two ways; the table gives medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.config.settings import load_settings
from app.engine.registry import Registry
from app.engine.service import Engine
from app.handoff.front import Ask, EngineClient
from app.handoff.loop import run_on_served_loop
from app.observe.metrics import Metrics
from app.process.engine_process import launch
from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_core.dtypes import DTYPES
from ffn_testing import tree_cpu_seconds

D_MODEL = 768
ENGINE_CORE, FRONT_CORE = 0, 1
F32 = DTYPES["float32"]


# The engine's settings, in-process and in its own process alike: one torch thread, a queue no load here fills.
ENGINE_SETTINGS: dict[str, Any] = {"torch_threads": 1, "log_level": "warning", "max_queue_rows": 1_000_000}


def engine_env(config: Path) -> dict[str, str]:
    """The engine process's environment: ENGINE_SETTINGS as FFN_* variables, none of this process's."""
    settings = {f"FFN_{name.upper()}": str(value) for name, value in ENGINE_SETTINGS.items()}
    return (
        {k: v for k, v in os.environ.items() if not k.startswith("FFN_")}
        | settings
        | {
            "FFN_CONFIG": str(config),
            "OMP_NUM_THREADS": "1",
        }
    )


async def closed_loop(call: Callable[[], Awaitable[np.ndarray]], concurrency: int, seconds: float) -> int:
    """Requests answered by `concurrency` tasks calling `call` back to back for `seconds`."""
    end = time.monotonic() + seconds
    answered = 0

    async def caller() -> None:
        nonlocal answered
        while time.monotonic() < end:
            await call()
            answered += 1

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return answered


def pin(core: int) -> None:
    if hasattr(os, "sched_setaffinity") and core < os.cpu_count():  # type: ignore[operator]
        os.sched_setaffinity(0, {core})


async def in_process(config: Path, rows: int, concurrency: int, seconds: float) -> dict[str, float]:
    pin(ENGINE_CORE)
    # As flags: the engine process's settings, without touching this process's environment.
    settings = load_settings(config=config, **ENGINE_SETTINGS)
    engine = Engine(settings, Registry(settings, Metrics()))
    await engine.start()
    await engine.until_warm()
    model = engine.model("ffn")
    x = np.random.default_rng(rows).standard_normal((rows, D_MODEL)).astype(np.float32)
    try:
        await closed_loop(lambda: model.infer(x, F32, deadline=None), concurrency, 0.3)  # warm-up
        cpu = time.process_time()
        start = time.monotonic()
        answered = await closed_loop(lambda: model.infer(x, F32, deadline=None), concurrency, seconds)
        wall, cpu = time.monotonic() - start, time.process_time() - cpu
    finally:
        await engine.stop()
    return {"requests_per_s": answered / wall, "engine_us": 1e6 * cpu / answered}


async def handed_off(socket: Path, engine_pid: int, rows: int, concurrency: int, seconds: float) -> dict[str, float]:
    pin(FRONT_CORE)
    client = EngineClient(socket)
    x = np.random.default_rng(rows).standard_normal((rows, D_MODEL)).astype(np.float32)
    try:
        await closed_loop(lambda: client.infer(Ask("ffn", None, x, F32, deadline=None)), concurrency, 0.3)
        engine_cpu, cpu = tree_cpu_seconds(engine_pid), time.process_time()
        start = time.monotonic()
        answered = await closed_loop(
            lambda: client.infer(Ask("ffn", None, x, F32, deadline=None)), concurrency, seconds
        )
        wall, cpu = time.monotonic() - start, time.process_time() - cpu
        engine_after = tree_cpu_seconds(engine_pid)
    finally:
        await client.close()
    assert engine_cpu is not None and engine_after is not None, "the engine's CPU time needs Linux's /proc"
    return {
        "requests_per_s": answered / wall,
        "engine_us": 1e6 * (engine_after - engine_cpu) / answered,
        "front_us": 1e6 * cpu / answered,
    }


def start_engine(config: Path, socket: Path) -> subprocess.Popen[bytes]:
    return launch(socket, engine_env(config), ["taskset", "-c", str(ENGINE_CORE)] if shutil.which("taskset") else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-ff", type=int, default=8, help="8: the near-free model of bench.transport")
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--quick", action="store_true", help="one round of 0.3 s per cell")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.concurrency = 1, 0.3, [1, 4]
    torch.manual_seed(0)
    cells: dict[tuple[int, int], dict[str, list[float]]] = {}
    previous = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    threads = torch.get_num_threads()  # the in-process engine sets one; given back at the end
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_ffn(build_ffn(FFNConfig(D_MODEL, args.d_ff, "gelu")), folder / "ffn.safetensors")
        config = folder / "ffn.toml"
        config.write_text('[[models]]\nname = "ffn"\nweights = "ffn.safetensors"\n')
        socket = folder / "engine.sock"
        engine = start_engine(config, socket)
        try:
            for round_ in range(args.rounds):
                for rows in args.rows:
                    for concurrency in args.concurrency:
                        cell = cells.setdefault((rows, concurrency), {})
                        direct = run_on_served_loop(in_process(config, rows, concurrency, args.seconds))
                        crossed = run_on_served_loop(handed_off(socket, engine.pid, rows, concurrency, args.seconds))
                        for key, value in direct.items():
                            cell.setdefault(f"in-process {key}", []).append(value)
                        for key, value in crossed.items():
                            cell.setdefault(f"hand-off {key}", []).append(value)
                print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr, flush=True)
        finally:
            engine.terminate()
            engine.wait(60)
            torch.set_num_threads(threads)
            if previous is not None:
                os.sched_setaffinity(0, previous)
    print(f"The hand-off against the engine in-process: d_model {D_MODEL}, d_ff {args.d_ff}, float32;")
    print(f"medians of {args.rounds} rounds of {args.seconds:g} s; CPU in µs per request")
    print()
    print(
        "| r | C | in-process req/s | hand-off req/s | in-process CPU | engine CPU | engine − in-process | front CPU |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (rows, concurrency), cell in cells.items():
        m = {key: statistics.median(values) for key, values in cell.items()}
        print(
            f"| {rows} | {concurrency} | {m['in-process requests_per_s']:,.0f} | {m['hand-off requests_per_s']:,.0f} "
            f"| {m['in-process engine_us']:.1f} | {m['hand-off engine_us']:.1f} "
            f"| {m['hand-off engine_us'] - m['in-process engine_us']:+.1f} | {m['hand-off front_us']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
