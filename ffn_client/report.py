"""A load run's results: counts, throughput and latency percentiles, as a table, JSON or a plot.

numpy only at import; rich and matplotlib are imported by the functions that draw.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p99.9": 99.9}
# Negative status codes stand for requests that got no HTTP answer at all.
TIMEOUT, CONNECT_ERROR, TRANSPORT_ERROR = -1, -2, -3
NO_ANSWER = {TIMEOUT: "timeout", CONNECT_ERROR: "connect", TRANSPORT_ERROR: "transport"}


@dataclass
class Samples:
    """One entry per measured request: send time (s from the measurement start), latency, status, rows."""

    start_s: np.ndarray
    latency_s: np.ndarray
    status: np.ndarray
    rows: np.ndarray

    @property
    def ok(self) -> np.ndarray:
        return self.status == 200


@dataclass
class Report:
    """What `run_load` measured. `sent == ok + sum(errors.values())` always holds."""

    config: dict[str, Any]
    duration_s: float  # the measured window: warmup excluded
    sent: int
    ok: int
    errors: dict[str, int]  # by HTTP status ("429"), or "timeout" / "connect" / "transport"
    rows_ok: int
    requests_per_s: float  # answered with 200, per second
    rows_per_s: float
    latency_ms: dict[str, float]  # over the 200s: p50, p90, p99, p99.9, max, mean
    warmup_requests: int = 0
    client_cpu_s: float = 0.0  # CPU the tester itself used, warmup included
    client_cpu_share: float = 0.0  # of one core over the run; near 1.0 the tester is the bottleneck
    samples: Samples | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The machine-readable report (no per-request samples)."""
        return {
            "config": self.config,
            "duration_s": round(self.duration_s, 4),
            "counts": {"sent": self.sent, "ok": self.ok, "errors": self.errors},
            "rows_ok": self.rows_ok,
            "requests_per_s": round(self.requests_per_s, 2),
            "rows_per_s": round(self.rows_per_s, 2),
            "latency_ms": {k: round(v, 4) for k, v in self.latency_ms.items()},
            "warmup_requests": self.warmup_requests,
            "client_cpu": {
                "seconds": round(self.client_cpu_s, 4),
                "share_of_one_core": round(self.client_cpu_share, 4),
                "us_per_request": round(1e6 * self.client_cpu_s / max(self.sent + self.warmup_requests, 1), 2),
            },
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def latency_stats(latency_s: np.ndarray) -> dict[str, float]:
    """Percentiles, max and mean in milliseconds; NaN when there are no samples."""
    if latency_s.size == 0:
        return {name: float("nan") for name in (*PERCENTILES, "max", "mean")}
    ms = latency_s * 1000.0
    stats = dict(zip(PERCENTILES, (float(v) for v in np.percentile(ms, list(PERCENTILES.values())))))
    stats["max"] = float(ms.max())
    stats["mean"] = float(ms.mean())
    return stats


def error_counts(status: np.ndarray) -> dict[str, int]:
    """Failed requests by status: '429', '503', ..., 'timeout', 'connect', 'transport'."""
    codes, counts = np.unique(status[status != 200], return_counts=True)
    return {NO_ANSWER.get(int(c), str(int(c))): int(n) for c, n in zip(codes, counts)}


def build_report(config: dict[str, Any], samples: Samples, duration_s: float, warmup_requests: int = 0) -> Report:
    ok = samples.ok
    rows_ok = int(samples.rows[ok].sum())
    duration_s = max(duration_s, 1e-9)
    return Report(
        config=config,
        duration_s=duration_s,
        sent=int(samples.status.size),
        ok=int(ok.sum()),
        errors=error_counts(samples.status),
        rows_ok=rows_ok,
        requests_per_s=float(ok.sum()) / duration_s,
        rows_per_s=rows_ok / duration_s,
        latency_ms=latency_stats(samples.latency_s[ok]),
        warmup_requests=warmup_requests,
        samples=samples,
    )


def render_table(report: Report) -> Any:
    """A rich Table of the report's figures."""
    from rich.table import Table

    cfg = report.config
    if cfg.get("rate"):
        mode = f"open loop, {cfg['rate']:g} req/s Poisson, {cfg.get('concurrency')} connections"
    else:
        mode = f"closed loop, concurrency {cfg.get('concurrency')}"
    table = Table(title="ffn-loadtest", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("target", f"{cfg.get('url')} model={cfg.get('model')}")
    table.add_row("load", mode)
    table.add_row("encoding / dtype / rows", f"{cfg.get('encoding')} / {cfg.get('dtype')} / {cfg.get('rows')}")
    table.add_row("duration (s)", f"{report.duration_s:.2f}")
    table.add_row("sent / ok", f"{report.sent} / {report.ok}")
    errors = ", ".join(f"{k}: {v}" for k, v in report.errors.items()) or "none"
    table.add_row("errors", errors, style="red" if report.errors else None)
    table.add_row("requests/s (ok)", f"{report.requests_per_s:,.1f}")
    table.add_row("rows/s (ok)", f"{report.rows_per_s:,.0f}")
    for name in (*PERCENTILES, "max"):
        table.add_row(f"latency {name} (ms)", f"{report.latency_ms[name]:.2f}")
    per_request = 1e6 * report.client_cpu_s / max(report.sent + report.warmup_requests, 1)
    busy = report.client_cpu_share > 0.8
    table.add_row(
        "tester CPU (one core)", f"{report.client_cpu_share:.0%}, {per_request:.0f} µs/request"
        + (" - tester-bound?" if busy else ""), style="yellow" if busy else None,
    )
    return table


def window_stats(samples: Samples, window_s: float = 1.0) -> dict[str, np.ndarray]:
    """Per window of send time: its start, ok requests/s and latency percentiles (ms)."""
    ok = samples.ok
    start, latency = samples.start_s[ok], samples.latency_s[ok] * 1000.0
    count = int(np.ceil(samples.start_s.max() / window_s)) if samples.start_s.size else 0
    index = np.minimum((start // window_s).astype(int), max(count - 1, 0))
    out: dict[str, list[float]] = {"t": [], "rps": [], **{k: [] for k in (*PERCENTILES, "max")}}
    for w in range(count):
        chosen = latency[index == w]
        out["t"].append(w * window_s)
        out["rps"].append(chosen.size / window_s)
        stats = latency_stats(chosen / 1000.0)
        for name in (*PERCENTILES, "max"):
            out[name].append(stats[name])
    return {k: np.asarray(v) for k, v in out.items()}


def plot_report(report: Report, path: str) -> None:
    """A PNG: latency percentiles over time in 1 s windows (with throughput), and the histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if report.samples is None:
        raise ValueError("this report has no samples to plot")
    samples = report.samples
    windows = window_stats(samples)
    cfg = report.config
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), constrained_layout=True)
    mode = f"open loop, {cfg['rate']:g} req/s Poisson" if cfg.get("rate") else f"closed loop, concurrency {cfg.get('concurrency')}"
    fig.suptitle(
        f"ffn-loadtest: {cfg.get('model')} {cfg.get('encoding')}/{cfg.get('dtype')}, rows {cfg.get('rows')}, {mode}\n"
        f"{report.requests_per_s:,.0f} req/s, {report.rows_per_s:,.0f} rows/s, "
        f"p50 {report.latency_ms['p50']:.1f} ms, p99 {report.latency_ms['p99']:.1f} ms, "
        f"errors {sum(report.errors.values())}/{report.sent}"
    )
    for name, style in (("p50", "-"), ("p90", "-"), ("p99", "-"), ("p99.9", "--"), ("max", ":")):
        top.plot(windows["t"] + 0.5, windows[name], style, marker=".", label=name)
    top.set_xlabel("time since measurement start (s), 1 s windows by send time")
    top.set_ylabel("latency (ms)")
    top.set_ylim(bottom=0)
    top.grid(alpha=0.3)
    rate_axis = top.twinx()
    rate_axis.bar(windows["t"] + 0.5, windows["rps"], width=0.9, alpha=0.12, color="gray", label="ok req/s")
    rate_axis.set_ylabel("ok requests/s", color="gray")
    rate_axis.set_ylim(bottom=0)
    top.set_zorder(rate_axis.get_zorder() + 1)
    top.patch.set_visible(False)
    top.legend(loc="upper left", ncols=5, fontsize="small")

    latency_ms = samples.latency_s[samples.ok] * 1000.0
    if latency_ms.size:
        bottom.hist(latency_ms, bins=min(100, max(10, latency_ms.size // 20)), color="tab:blue", alpha=0.8)
        for name, color in (("p50", "tab:green"), ("p99", "tab:red")):
            value = report.latency_ms[name]
            bottom.axvline(value, color=color, linestyle="--", label=f"{name} {value:.1f} ms")
        bottom.legend()
    bottom.set_xlabel("latency (ms)")
    bottom.set_ylabel("requests")
    bottom.set_title("latency histogram (status 200)")
    bottom.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)
