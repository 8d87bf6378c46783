"""Sweeps, as perf_analyzer runs them: one load run per concurrency or rate, the same bounds for each.

    --concurrency-range 1:64:x2     1, 2, 4, ..., 64 workers (closed loop)
    --rate-range 100:500:100        100, 200, ..., 500 requests/s (open loop)

A range is START[:END[:STEP]], END included; STEP is added, or with an `x` multiplied (perf_analyzer
has only the added step; the doubling is what a search for the knee wants).
"""

from __future__ import annotations

import csv
import io
import math
import sys
from collections.abc import Callable
from dataclasses import replace

from ffn_client.load import LoadConfig, Progress, run_load
from ffn_client.report import CSV_COLUMNS, Report

MAX_STEPS = 64  # a range longer than this is a typo (1:10000:1), not a plan


def parse_range(text: str, *, integer: bool) -> list[float]:
    """The values of START[:END[:STEP]] (STEP: +N, or xN to multiply); ValueError names what is wrong."""
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or not all(parts):
        raise ValueError(f"a range is START[:END[:STEP]], got {text!r}")
    kind = "an integer" if integer else "a number"
    try:
        start = int(parts[0]) if integer else float(parts[0])
        end = (int(parts[1]) if integer else float(parts[1])) if len(parts) > 1 else start
        step_text = parts[2] if len(parts) > 2 else "1"
        multiply = step_text.startswith("x")
        step = float(step_text[1:]) if multiply else int(step_text) if integer else float(step_text)
    except ValueError:
        raise ValueError(f"START and END must be {kind} and STEP {kind} or xFACTOR, got {text!r}") from None
    if not 0 < start <= end or not math.isfinite(end):
        raise ValueError(f"a range needs 0 < START <= END, got {text!r}")
    if not (step > 1 if multiply else step > 0) or not math.isfinite(step):
        raise ValueError(f"STEP must be > 0, or xFACTOR with FACTOR > 1, got {text!r}")
    values: list[float] = []
    k = 0
    while True:
        value = start * step**k if multiply else start + k * step
        value = round(value) if integer else value
        if value > end * (1 + 1e-9):
            break
        if not values or value != values[-1]:  # x1.5 over small integers repeats a value
            values.append(value)
        if len(values) > MAX_STEPS:
            raise ValueError(f"{text!r} has more than {MAX_STEPS} steps")
        k += 1
    return values


async def run_sweep(
    base: LoadConfig, axis: str, values: list[float], progress: Callable[[int, Progress], None] | None = None
) -> list[Report]:
    """One run per value of `axis` ("concurrency" or "rate"), in order; progress gets the step's index."""
    assert axis in ("concurrency", "rate"), f"no sweep over {axis!r}. This is a bug."
    reports: list[Report] = []
    for i, value in enumerate(values):
        config = replace(base, concurrency=int(value)) if axis == "concurrency" else replace(base, rate=value)
        if reports and config.d_model is None:  # asked once, at the first step
            config = replace(config, d_model=reports[0].config["d_model"])
        step_progress = (lambda p, i=i: progress(i, p)) if progress else None
        reports.append(await run_load(config, step_progress))
    return reports


def write_csv(reports: list[Report], path: str) -> None:
    """One row per run (CSV_COLUMNS) to `path`, or to stdout for '-'."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for report in reports:
        writer.writerow(report.csv_row())
    if path == "-":
        sys.stdout.write(buffer.getvalue())
    else:
        with open(path, "w", newline="") as f:
            f.write(buffer.getvalue())
