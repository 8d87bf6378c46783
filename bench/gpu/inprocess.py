"""In-process FFN throughput on one device, by batch rows and precision: eager, CUDA graphs, and the runner.

Three paths per cell, all through the service's own classes:
- eager: `model(x)` on rows already on the device;
- graphs: the runner's BucketedForward on the same rows (the copy into the static input, then
  the bucket's CUDA graph replayed; on the CPU, where there are no graphs, the padded eager call);
- runner: `ModelRunner([rows])` from float32 rows on the host, what the batcher calls: staging,
  both copies and the wait included.
Device time is taken with CUDA events, the host's with perf_counter; each cell is the median of
several timed runs after a warm-up.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from app.engine.runner import ModelRunner, set_tf32
from ffn_core import FeedForward, GatedFeedForward, fuse_gate

# mode -> (compute dtype, TF32 on)
MODES: dict[str, tuple[torch.dtype, bool]] = {
    "float32": (torch.float32, False),
    "tf32": (torch.float32, True),
    "bfloat16": (torch.bfloat16, False),
    "float16": (torch.float16, False),
}
PATHS = ("eager", "graphs", "runner")


@dataclass
class Cell:
    mode: str
    path: str
    rows: int
    ms_per_call: float
    rows_per_s: float
    tflops: float  # dense FLOP/s of the FFN's matmuls, in TFLOP/s


def flops_per_row(model: FeedForward) -> int:
    """Multiply-adds x 2 of the matmuls: d_model x d_ff for W1 (and V when gated) and for W2."""
    c = model.config
    return 2 * c.d_model * c.d_ff * (3 if c.gated else 2)


def seconds_per_call(
    fn: Callable[[], object], device: torch.device, budget_s: float, repeats: int = 5, *, host_clock: bool = False
) -> float:
    """Median seconds per call of `fn` over `repeats` timed runs, after a warm-up; about `budget_s` in all.

    CUDA work is timed with events on the current stream; `host_clock` times with perf_counter
    instead, for a call that waits for its own work on streams of its own (the runner).
    """
    cuda = device.type == "cuda" and not host_clock
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    once = max(time.perf_counter() - start, 1e-6)
    calls = max(1, int(budget_s / repeats / once))
    samples = []
    for _ in range(repeats):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / 1000.0 / calls)
        else:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def measure_mode(
    base: FeedForward, mode: str, rows_list: list[int], device: torch.device, budget_s: float
) -> list[Cell]:
    """Every (path, rows) cell of one precision mode."""
    dtype, tf32 = MODES[mode]
    set_tf32(tf32)
    model = copy.deepcopy(base).to(device=device, dtype=dtype).requires_grad_(False)
    if isinstance(model, GatedFeedForward):
        model = fuse_gate(model)
    # On the CPU there are no graphs: `pad` puts the padded eager call in the graphs column.
    runner = ModelRunner(model, max_batch_rows=max(rows_list), tf32=tf32, pad=device.type != "cuda")
    runner.warm_up()
    per_row = flops_per_row(model)
    generator = torch.Generator().manual_seed(0)
    cells = []
    with torch.inference_mode():
        for rows in rows_list:
            host = torch.randn(rows, model.config.d_model, generator=generator)
            on_device = host.to(device, dtype)
            calls: dict[str, Callable[[], object]] = {
                "eager": partial(model, on_device),
                "graphs": partial(runner.bucketed, on_device),
                "runner": partial(runner, [host]),
            }
            for path, fn in calls.items():
                seconds = seconds_per_call(fn, device, budget_s, host_clock=path == "runner")
                cells.append(Cell(mode, path, rows, seconds * 1000, rows / seconds, rows * per_row / seconds / 1e12))
    del runner, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    set_tf32(False)
    return cells


def measure(
    base: FeedForward,
    modes: list[str],
    rows_list: list[int],
    device: torch.device,
    budget_s: float,
    progress: Callable[[str], None] = print,
) -> list[Cell]:
    cells = []
    for mode in modes:
        mode_cells = measure_mode(base, mode, rows_list, device, budget_s)
        for cell in mode_cells:
            progress(
                f"in-process {cell.mode:>8} {cell.path:>6} rows={cell.rows:<6} {cell.rows_per_s:>14,.0f} rows/s "
                f"{cell.tflops:8.1f} TFLOP/s"
            )
        cells += mode_cells
    return cells


def profile_forward(base: FeedForward, mode: str, rows: int, device: torch.device) -> str:
    """torch.profiler's table for eager and graph-replayed forwards at `rows`: where a pass spends its time."""
    from torch.profiler import ProfilerActivity, profile

    dtype, tf32 = MODES[mode]
    set_tf32(tf32)
    model = copy.deepcopy(base).to(device=device, dtype=dtype).requires_grad_(False)
    if isinstance(model, GatedFeedForward):
        model = fuse_gate(model)
    runner = ModelRunner(model, max_batch_rows=rows, tf32=tf32, pad=device.type != "cuda")
    runner.warm_up()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    x = torch.randn(rows, model.config.d_model).to(device, dtype)
    tables = []
    with torch.inference_mode():
        for name, fn in (("eager", lambda: model(x)), ("graphs", lambda: runner.bucketed(x))):
            with profile(activities=activities) as prof:
                for _ in range(20):
                    fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
            tables.append(
                f"## {mode}, {rows} rows, {name}, 20 calls\n\n" + prof.key_averages().table(sort_by=sort, row_limit=15)
            )
    set_tf32(False)
    return "\n\n".join(tables)


@dataclass
class Invariance:
    mode: str  # "default" or "batch_invariant"
    dtype: str
    max_abs_diff: float  # largest |batched − alone| over the probe row's elements and batches
    max_rel_diff: float  # the same over the largest |alone| element


def invariance(base: FeedForward, device: torch.device, dtype: torch.dtype, rows: int = 64) -> list[Invariance]:
    """How far a row's answer moves when it is batched: alone against at several positions and batch sizes."""
    model = copy.deepcopy(base).to(device=device, dtype=dtype).requires_grad_(False)
    d = model.config.d_model
    generator = torch.Generator().manual_seed(1)
    probe = torch.randn(1, d, generator=generator)
    found = []
    for mode, fixed in (("default", None), ("batch_invariant", rows)):
        runner = ModelRunner(model, max_batch_rows=1024, batch_invariant_rows=fixed)
        runner.warm_up()
        alone = runner([probe])[0].double()
        worst = 0.0
        for size, at in ((2, 1), (7, 3), (rows, rows - 1), (rows + 1, rows), (1000, 517)):
            batch = torch.randn(size, d, generator=generator)
            batch[at] = probe[0]
            worst = max(worst, (runner([batch])[at].double() - alone).abs().max().item())
        found.append(Invariance(mode, str(dtype).removeprefix("torch."), worst, worst / alone.abs().max().item()))
    return found
