"""In-process FFN throughput, no HTTP: rows/s by batch rows, dtype and torch threads.

    python3 -m bench.micro                       # 768/3072 GELU; float32, bfloat16, float16; 1 and all threads
    python3 -m bench.micro --dtypes float32 --threads 1 --max-rows 256 --seconds 0.2 --json

The ceiling the service can reach on one machine: every HTTP benchmark is read against it.
Other benchmark scripts reuse `measure_rows_per_s`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time

import torch

from ffn_core import FeedForward, FFNConfig, build_ffn
from ffn_core.activations import ACTIVATIONS
from ffn_core.dtypes import DTYPES
from ffn_core.torch_dtypes import TORCH


def measure_rows_per_s(model: FeedForward, rows: int, dtype: torch.dtype, threads: int, min_seconds: float) -> float:
    """Rows per second of `model` on batches of `rows` rows in `dtype` with `threads` torch threads.

    Warms up first (allocation, kernel choice), then times forward passes under
    torch.inference_mode until `min_seconds` have passed. The model is cast to `dtype` if it is
    not in it already (a copy: the caller's model is left alone).
    """
    param = next(model.parameters())
    if param.dtype != dtype:
        model = copy.deepcopy(model).to(dtype)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, model.config.d_model, generator=generator).to(device=param.device, dtype=dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            _time_calls(model, x, min_seconds / 5)  # warm-up
            calls, elapsed = _time_calls(model, x, min_seconds)
    finally:
        torch.set_num_threads(previous)
    return rows * calls / elapsed


def _time_calls(model: FeedForward, x: torch.Tensor, min_seconds: float) -> tuple[int, float]:
    """(calls, seconds): forward passes run back to back for at least `min_seconds`, at least two."""
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    calls = 0
    start = time.perf_counter()
    while True:
        model(x)
        sync()  # a CUDA call returns before the work is done
        calls += 1
        elapsed = time.perf_counter() - start
        if calls >= 2 and elapsed >= min_seconds:
            return calls, elapsed


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m bench.micro", description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--d-ff", type=int, default=3072)
    parser.add_argument("--activation", choices=sorted(ACTIVATIONS), default="gelu")
    parser.add_argument("--gated", action="store_true", help="gated (GLU) variant")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16", help=f"comma-separated, of {list(DTYPES)}")
    parser.add_argument("--threads", default="1,all", help="comma-separated torch thread counts; 'all' = every CPU")
    parser.add_argument("--max-rows", type=int, default=4096, help="batch rows go 1, 2, 4, ... up to this")
    parser.add_argument("--seconds", type=float, default=1.0, help="minimum timed duration per cell")
    parser.add_argument(
        "--repeat", type=int, default=1, help="time each cell this many times and keep the best (for a busy machine)"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    args = parser.parse_args(argv)
    try:
        args.dtypes = [TORCH[name] for name in args.dtypes.split(",")]
    except KeyError as exc:
        parser.error(f"unknown dtype {exc}; choose from {list(DTYPES)}")
    args.threads = [(os.cpu_count() or 1) if t == "all" else int(t) for t in args.threads.split(",")]
    args.threads = list(dict.fromkeys(args.threads))  # "1,all" on one CPU is one column
    args.rows = [2**i for i in range(args.max_rows.bit_length()) if 2**i <= args.max_rows]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    config = FFNConfig(args.d_model, args.d_ff, args.activation, gated=args.gated)
    torch.manual_seed(0)
    base = build_ffn(config)
    load_before = os.getloadavg()[0]
    results = []
    for dtype in args.dtypes:
        model = build_ffn(config).to(device=args.device, dtype=dtype)
        model.load_state_dict(base.state_dict())
        for threads in args.threads:
            for rows in args.rows:
                rate = max(measure_rows_per_s(model, rows, dtype, threads, args.seconds) for _ in range(args.repeat))
                name = str(dtype).removeprefix("torch.")
                results.append({"rows": rows, "dtype": name, "threads": threads, "rows_per_s": rate})
                print(f"{name:>8} threads={threads:<3} rows={rows:<5} {rate:>14,.0f} rows/s", file=sys.stderr)
    env = {
        "torch": torch.__version__,
        "device": args.device,
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        # Other processes on the machine skew every cell, the multi-threaded ones most.
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    if args.json:
        timing = {"seconds": args.seconds, "repeat": args.repeat}
        print(json.dumps({"config": config.to_dict(), "env": env, **timing, "results": results}, indent=2))
    else:
        print(_table(config, env, results))
    return 0


def _table(config: FFNConfig, env: dict, results: list[dict]) -> str:
    """Markdown: one line per batch size, one column per (dtype, threads)."""
    columns = list(dict.fromkeys((r["dtype"], r["threads"]) for r in results))
    cells = {(r["rows"], r["dtype"], r["threads"]): r["rows_per_s"] for r in results}
    lines = [
        f"{config.variant} FFN, d_model {config.d_model}, d_ff {config.d_ff}; "
        f"torch {env['torch']} on {env['device']} ({env['cpus']} CPUs, 1-min load average "
        f"{env['load_average'][0]} before, {env['load_average'][1]} after); rows/s",
        "",
        "| rows | " + " | ".join(f"{d} t={t}" for d, t in columns) + " |",
        "|---:|" + "---:|" * len(columns),
    ]
    for rows in dict.fromkeys(r["rows"] for r in results):
        lines.append(f"| {rows} | " + " | ".join(f"{cells[rows, d, t]:,.0f}" for d, t in columns) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
