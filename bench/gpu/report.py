"""The GPU benchmark's tables, its four targets and its plot, from the measured cells."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from bench.gpu.inprocess import PATHS, Cell, Invariance
from bench.gpu.service import ServiceCell

# Dense (no sparsity) bfloat16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s, matched on the
# device name torch reports, most specific first.
BF16_PEAK_TFLOPS: list[tuple[str, float]] = [
    ("H200", 989.4),  # SXM; the NVL part is lower
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),  # "NVIDIA H100 80GB HBM3": SXM5
    ("A100", 312.0),
    ("L40S", 362.1),
    ("L4", 121.0),
]


def bf16_peak_tflops(device_name: str) -> float | None:
    """The dense bfloat16 peak of the named GPU, or None for a device not in the table (a CPU too)."""
    for key, peak in BF16_PEAK_TFLOPS:
        if key in device_name:
            return peak
    return None


@dataclass
class Target:
    name: str
    goal: str
    measured: str
    met: bool | None  # None: not measured here


def _cell(
    cells: list[ServiceCell], server: str, workers: int, rows: int, concurrency: int | None = None
) -> ServiceCell | None:
    for c in cells:
        if (c.server, c.workers, c.rows) == (server, workers, rows) and (
            concurrency is None or c.concurrency == concurrency
        ):
            return c
    return None


def shared_engine_targets(service: list[ServiceCell], concurrency: int) -> list[Target]:
    """Issue 30's targets for its layout (N fronts, one engine process: server "ffn+engine")."""
    shared = "ffn+engine"
    result = []
    one, eight = _cell(service, shared, 1, 16, concurrency), _cell(service, shared, 8, 16, concurrency)
    if one and eight:
        ratio = eight.rows_per_s / one.rows_per_s
        result.append(Target("fronts: 8 vs 1, r=16", "≥ 6×", f"{ratio:.2f}×", ratio >= 6))
        result.append(
            Target("fronts: 8, r=16", "≥ 1,000,000 rows/s", f"{eight.rows_per_s:,.0f} rows/s", eight.rows_per_s >= 1e6)
        )
    else:
        result.append(Target("fronts: 8 vs 1, r=16", "≥ 6×", "not measured (no 1- and 8-front cells)", None))
    single = _cell(service, shared, 8, 1, concurrency)
    if single:
        result.append(
            Target(
                "fronts: 8, r=1",
                "≥ 50,000 req/s",
                f"{single.requests_per_s:,.0f} req/s",
                single.requests_per_s >= 50_000,
            )
        )
    shares = []
    for workers in sorted({c.workers for c in service if c.server == shared}):
        ffn, echo = _cell(service, shared, workers, 256, concurrency), _cell(service, "echo", workers, 256, concurrency)
        if ffn and echo and echo.bytes_per_s > 0:
            shares.append((workers, ffn.bytes_per_s / echo.bytes_per_s))
    if shares:
        text = ", ".join(f"{w} f: {share:.0%}" for w, share in shares)
        result.append(Target("fronts: binary r=256 vs echo bytes/s", "≥ 70 %", text, min(s for _, s in shares) >= 0.7))
    lone = _cell(service, shared, min((c.workers for c in service), default=1), 1, 1)
    if lone:
        result.append(Target("fronts: r=1, one client, p50", "≤ 0.5 ms", f"{lone.p50_ms:.3f} ms", lone.p50_ms <= 0.5))
    return result


def targets(
    inprocess: list[Cell], service: list[ServiceCell], device_name: str, peak: float | None, concurrency: int
) -> list[Target]:
    """The issue's four targets, each measured or said to be missing."""
    result = []
    one, eight = _cell(service, "ffn", 1, 16, concurrency), _cell(service, "ffn", 8, 16, concurrency)
    if one and eight:
        ratio = eight.rows_per_s / one.rows_per_s
        result.append(
            Target(
                "8 workers vs 1, r=16",
                "≥ 6×",
                f"{ratio:.2f}× ({eight.rows_per_s:,.0f} vs {one.rows_per_s:,.0f} rows/s)",
                ratio >= 6,
            )
        )
    else:
        result.append(Target("8 workers vs 1, r=16", "≥ 6×", "not measured (no 8-worker cell)", None))
    shares = []
    for workers in sorted({c.workers for c in service}):
        ffn, echo = _cell(service, "ffn", workers, 256, concurrency), _cell(service, "echo", workers, 256, concurrency)
        if ffn and echo and echo.bytes_per_s > 0:
            shares.append((workers, ffn.bytes_per_s / echo.bytes_per_s))
    if shares:
        worst = min(share for _, share in shares)
        text = ", ".join(f"{w} w: {share:.0%}" for w, share in shares)
        result.append(Target("binary r=256 vs echo bytes/s", "≥ 70 % at each worker count", text, worst >= 0.7))
    else:
        result.append(Target("binary r=256 vs echo bytes/s", "≥ 70 %", "not measured (no r=256 cells)", None))
    lone = _cell(service, "ffn", min((c.workers for c in service), default=1), 1, 1)
    if lone:
        result.append(Target("r=1, one client, p50", "≤ 1 ms", f"{lone.p50_ms:.3f} ms", lone.p50_ms <= 1.0))
    else:
        result.append(Target("r=1, one client, p50", "≤ 1 ms", "not measured", None))
    if any(c.server == "ffn+engine" for c in service):
        result.extend(shared_engine_targets(service, concurrency))
    bf16 = [c for c in inprocess if (c.mode, c.path) == ("bfloat16", "graphs")]
    at = max((c for c in bf16 if c.rows <= 8192), key=lambda c: c.rows, default=None)
    if at is None:
        result.append(Target("bf16 in-process at 8192 rows", "≥ 40 % of dense bf16 peak", "not measured", None))
    elif peak is None:
        result.append(
            Target(
                f"bf16 in-process at {at.rows} rows",
                "≥ 40 % of dense bf16 peak",
                f"{at.tflops:.1f} TFLOP/s; no peak known for {device_name!r}",
                None,
            )
        )
    else:
        share = at.tflops / peak
        result.append(
            Target(
                f"bf16 in-process at {at.rows} rows",
                "≥ 40 % of dense bf16 peak",
                f"{at.tflops:.1f} of {peak:g} TFLOP/s = {share:.0%}",
                share >= 0.4 and at.rows == 8192,
            )
        )
    return result


def inprocess_table(cells: list[Cell]) -> str:
    """rows/s by batch rows: one column per (mode, path); a TFLOP/s column for bfloat16 graphs."""
    columns = list(dict.fromkeys((c.mode, c.path) for c in cells))
    by = {(c.rows, c.mode, c.path): c for c in cells}
    header = "| rows | " + " | ".join(f"{m} {p}" for m, p in columns) + " | bf16 graphs TFLOP/s |"
    lines = [header, "|---:|" + "---:|" * (len(columns) + 1)]
    for rows in sorted({c.rows for c in cells}):
        values = [f"{by[rows, m, p].rows_per_s:,.0f}" if (rows, m, p) in by else "" for m, p in columns]
        bf16 = by.get((rows, "bfloat16", "graphs"))
        values.append(f"{bf16.tflops:.1f}" if bf16 else "")
        lines.append(f"| {rows} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def invariance_table(drift: list[Invariance]) -> str:
    lines = ["| mode | dtype | max abs difference | relative to the row's largest value |", "|---|---|---:|---:|"]
    lines += [f"| {d.mode} | {d.dtype} | {d.max_abs_diff:.3g} | {d.max_rel_diff:.3g} |" for d in drift]
    return "\n".join(lines)


def service_table(cells: list[ServiceCell]) -> str:
    lines = [
        "| server | workers | r | C | req/s | rows/s | MB/s (in+out) | p50 ms | p99 ms | errors | "
        "server CPU ms/req | rows/batch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in sorted(cells, key=lambda c: (c.workers, c.rows, c.concurrency, c.server)):
        batch = "" if math.isnan(c.mean_batch_rows) else f"{c.mean_batch_rows:.1f}"
        lines.append(
            f"| {c.server} | {c.workers} | {c.rows} | {c.concurrency} | {c.requests_per_s:,.0f} | "
            f"{c.rows_per_s:,.0f} | {c.bytes_per_s / 1e6:,.1f} | {c.p50_ms:.3f} | {c.p99_ms:.3f} | "
            f"{c.errors} | {c.server_cpu_ms_per_request:.3f} | {batch} |"
        )
    return "\n".join(lines)


def targets_table(found: list[Target]) -> str:
    lines = ["| target | goal | measured | |", "|---|---|---|---|"]
    for t in found:
        verdict = "not measured" if t.met is None else ("met" if t.met else "**missed**")
        lines.append(f"| {t.name} | {t.goal} | {t.measured} | {verdict} |")
    return "\n".join(lines)


def plot(inprocess: list[Cell], service: list[ServiceCell], path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    styles = {"eager": ":", "graphs": "-", "runner": "--"}
    for mode in dict.fromkeys(c.mode for c in inprocess):
        for path_name in PATHS:
            sel = sorted((c for c in inprocess if (c.mode, c.path) == (mode, path_name)), key=lambda c: c.rows)
            if sel:
                left.plot(
                    [c.rows for c in sel],
                    [c.rows_per_s for c in sel],
                    styles[path_name],
                    marker=".",
                    label=f"{mode} {path_name}",
                )
    left.set_xscale("log", base=2)
    left.set(yscale="log", xlabel="batch rows", ylabel="rows/s", title="In-process, by precision and path")
    for server, marker in (("ffn", "o"), ("ffn+engine", "^"), ("echo", "s")):
        for rows in sorted({c.rows for c in service if c.concurrency > 1}):
            by_workers = sorted(
                (c for c in service if (c.server, c.rows) == (server, rows) and c.concurrency > 1),
                key=lambda c: c.workers,
            )
            if by_workers:
                right.plot(
                    [c.workers for c in by_workers],
                    [c.bytes_per_s / 1e6 for c in by_workers],
                    marker=marker,
                    linestyle="--" if server == "echo" else "-",
                    label=f"{server} r={rows}",
                )
    right.set_xscale("log", base=2)
    right.set_xticks(sorted({c.workers for c in service}) or [1])
    right.set(
        yscale="log",
        xlabel="workers",
        ylabel="MB/s, request + answer bodies",
        title="Service against the echo baseline",
    )
    for ax in (left, right):
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))  # 1024, not 2^10
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
