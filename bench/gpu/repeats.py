"""The service cells of several bench.gpu runs as medians with their ranges, and the targets read off the medians.

    python3 -m bench.gpu.repeats RUN_DIR [RUN_DIR ...]     # each holding a service.json

One run of a 4 s cell on a shared host is one draw; this puts the runs of the same command side by
side. A cell missing from some runs (a run stopped at its time limit) gets the median of the runs
that have it, and the table says how many that was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

from bench.gpu import report
from bench.gpu.service import ServiceCell

CellKey = tuple[str, int, int, int]  # server, workers, rows per request, connections


def load_runs(folders: list[Path]) -> list[list[ServiceCell]]:
    """Each folder's service.json as cells; a folder without one is an error the caller reports."""
    runs = []
    for folder in folders:
        path = folder / "service.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no service.json (was the run's service part skipped?)")
        runs.append([ServiceCell(**cell) for cell in json.loads(path.read_text())])
    return runs


def _key(cell: ServiceCell) -> CellKey:
    return (cell.server, cell.workers, cell.rows, cell.concurrency)


def _median(values: list[float]) -> float:
    present = [v for v in values if not math.isnan(v)]
    return statistics.median(present) if present else math.nan


def grouped(runs: list[list[ServiceCell]]) -> dict[CellKey, list[ServiceCell]]:
    """Every cell's measurements across runs, in the order the cells first appear."""
    by: dict[CellKey, list[ServiceCell]] = {}
    for run in runs:
        for cell in run:
            by.setdefault(_key(cell), []).append(cell)
    return by


def median_cell(draws: list[ServiceCell]) -> ServiceCell:
    """A cell whose every number is the median of that number over the draws (errors: the largest)."""
    first = draws[0]
    return ServiceCell(
        first.server,
        first.workers,
        first.rows,
        first.concurrency,
        _median([d.requests_per_s for d in draws]),
        _median([d.rows_per_s for d in draws]),
        _median([d.bytes_per_s for d in draws]),
        _median([d.p50_ms for d in draws]),
        _median([d.p99_ms for d in draws]),
        max(d.errors for d in draws),
        _median([d.server_cpu_ms_per_request for d in draws]),
        _median([d.mean_batch_rows for d in draws]),
        first.generator,
    )


def _span(values: list[float], fmt: str) -> str:
    """'median (low–high)', or the one value where there is one."""
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def medians_table(by: dict[CellKey, list[ServiceCell]]) -> str:
    lines = [
        "| server | workers | r | C | runs | rows/s | p50 ms | p99 ms | server CPU ms/req | rows/batch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key in sorted(by, key=lambda k: (k[1], k[2], k[3], k[0])):
        draws = by[key]
        batch = median_cell(draws).mean_batch_rows
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {len(draws)} | "
            f"{_span([d.rows_per_s for d in draws], ',.0f')} | {_span([d.p50_ms for d in draws], '.3f')} | "
            f"{_span([d.p99_ms for d in draws], '.3f')} | "
            f"{_span([d.server_cpu_ms_per_request for d in draws], '.3f')} | "
            f"{'' if math.isnan(batch) else f'{batch:.1f}'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.gpu.repeats", description=__doc__)
    p.add_argument("runs", nargs="+", type=Path, help="result folders of bench.gpu runs")
    p.add_argument("--concurrency", type=int, default=64, help="the runs' --concurrency, for the targets")
    p.add_argument("--json", type=Path, help="also write the median cells here")
    args = p.parse_args(argv)
    try:
        runs = load_runs(args.runs)
    except FileNotFoundError as error:
        print(f"bench.gpu.repeats: {error}", file=sys.stderr)
        return 2
    by = grouped(runs)
    medians = [median_cell(draws) for draws in by.values()]
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(c) for c in medians], indent=1))
    # The in-process target needs no repeats here: its cells are medians of five timed runs already.
    found = [t for t in report.targets([], medians, "", None, args.concurrency) if not t.name.startswith("bf16")]
    print(f"### The service over {len(runs)} runs: medians (lowest–highest)\n")
    print(medians_table(by))
    print("\n### The service's targets, on the medians\n")
    print(report.targets_table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
