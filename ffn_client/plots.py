"""ffn-loadtest's plots (matplotlib, imported when drawing): one run over time, or a sweep's curve."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ffn_client.report import Report, window_stats


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _workload(cfg: dict[str, Any]) -> str:
    return f"{cfg.get('model')} {cfg.get('encoding')}/{cfg.get('dtype')}, rows {cfg.get('rows')}"


def plot_run(report: Report, path: str) -> None:
    """A PNG: latency percentiles over time in 1 s windows (with throughput), and the histogram."""
    plt = _pyplot()
    if report.samples is None:
        raise ValueError("this report has no samples to plot")
    samples = report.samples
    windows = window_stats(samples)
    cfg = report.config
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), constrained_layout=True)
    mode = (
        f"open loop, {cfg['rate']:g} req/s Poisson"
        if cfg.get("rate")
        else f"closed loop, concurrency {cfg.get('concurrency')}"
    )
    fig.suptitle(
        f"ffn-loadtest: {_workload(cfg)}, {mode}\n"
        f"{report.requests_per_s:,.0f} req/s, {report.rows_per_s:,.0f} rows/s, "
        f"p50 {report.latency_ms['p50']:.1f} ms, p99 {report.latency_ms['p99']:.1f} ms, "
        f"errors {sum(report.errors.values())}/{report.sent}"
    )
    for name, style in (("p50", "-"), ("p90", "-"), ("p99", "-"), ("p99.9", "--"), ("max", ":")):
        top.plot(windows["t"] + 0.5, windows[name], style, marker=".", label=name)
    top.set_xlabel("time since measurement start (s), 1 s windows by start time")
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


def plot_sweep(reports: list[Report], path: str, max_p99_ms: float | None = None) -> None:
    """A PNG: throughput against latency (p50, p99) over the sweep, and the server's breakdown per step."""
    plt = _pyplot()
    cfg = reports[0].config
    open_loop = bool(cfg.get("rate"))
    labels = [r.label for r in reports]
    fig, (curve, parts) = plt.subplots(2, 1, figsize=(10, 9), height_ratios=(3, 2), constrained_layout=True)
    axis = "request rate" if open_loop else "concurrency"
    fig.suptitle(
        f"ffn-loadtest sweep over {axis} {labels[0]} → {labels[-1]}: {_workload(cfg)}\n"
        f"{cfg.get('url')}, each step {_bounds(cfg)}"
    )

    rps = np.array([r.requests_per_s for r in reports])
    for name, marker, color in (("p50", "o", "tab:green"), ("p99", "s", "tab:red")):
        latency = np.array([r.latency_ms[name] for r in reports])
        curve.plot(rps, latency, marker=marker, color=color, label=f"{name} latency")
    for r, x in zip(reports, rps, strict=True):  # label each point of the p99 curve with its step
        curve.annotate(r.label, (x, r.latency_ms["p99"]), textcoords="offset points", xytext=(4, 6), fontsize="small")
    short = [r for r in reports if r.offered is not None and not r.offered.reached]
    if short:
        curve.scatter(
            [r.requests_per_s for r in short],
            [r.latency_ms["p99"] for r in short],
            s=160,
            facecolors="none",
            edgecolors="orange",
            linewidths=2,
            label="rate not offered in full",
            zorder=3,
        )
    broken = [r for r in reports if r.breaches]
    if broken:
        curve.scatter(
            [r.requests_per_s for r in broken],
            [r.latency_ms["p99"] for r in broken],
            marker="x",
            s=90,
            color="black",
            label="threshold broken",
            zorder=4,
        )
    if max_p99_ms is not None:
        curve.axhline(max_p99_ms, color="tab:red", linestyle=":", label=f"--max-p99-ms {max_p99_ms:g}")
    finite = [v for r in reports for v in (r.latency_ms["p50"], r.latency_ms["p99"]) if v > 0 and not math.isnan(v)]
    if finite and max(finite) / min(finite) > 30:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        curve.set_yscale("log")  # 2 ms and 300 ms on one axis; ticks at 1, 2, 5 x 10^n, written plainly
        curve.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        curve.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        curve.yaxis.set_minor_formatter(NullFormatter())
    else:
        curve.set_ylim(bottom=0)
    curve.set_xlim(0, 1.1 * float(np.nanmax(rps)) if np.nanmax(rps) > 0 else 1)  # room for the labels
    curve.set_xlabel("throughput: requests/s answered 200")
    curve.set_ylabel("client-side latency (ms)")
    curve.set_title("throughput against latency, one point per step (labels: the step)", fontsize="medium")
    curve.grid(alpha=0.3, which="both")
    curve.legend(loc="upper left", fontsize="small")

    _plot_breakdown(parts, reports, labels)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _bounds(cfg: dict[str, Any]) -> str:
    bounds = [
        f"{cfg['duration']:g} s" if cfg.get("duration") else "",
        f"{cfg['requests']} requests" if cfg.get("requests") else "",
    ]
    warmup = f" after {cfg['warmup']:g} s warmup" if cfg.get("warmup") else ""
    return " or ".join(b for b in bounds if b) + warmup


def _plot_breakdown(ax: Any, reports: list[Report], labels: list[str]) -> None:
    """Per step: the server's mean queue and compute stacked, its total, and the client's mean latency."""
    x = np.arange(len(reports))
    if all(r.server is None for r in reports):
        ax.text(0.5, 0.5, f"no server breakdown: {reports[0].server_note}", ha="center", va="center", wrap=True)
        ax.set_axis_off()
        return
    nan = float("nan")
    queue = np.array([r.server.queue.mean_ms if r.server else nan for r in reports])
    compute = np.array([r.server.compute.mean_ms if r.server else nan for r in reports])
    total = np.array([r.server.total.mean_ms if r.server else nan for r in reports])
    client = np.array([r.latency_ms["mean"] for r in reports])
    ax.bar(x, queue, width=0.6, color="tab:orange", label="server: queue wait (mean per request)")
    ax.bar(
        x,
        compute,
        width=0.6,
        bottom=np.nan_to_num(queue),
        color="tab:blue",
        label="server: forward pass (mean per batch)",
    )
    ax.plot(x, total, "k_", markersize=28, markeredgewidth=2.5, label="server: total (mean per request)")
    # The axis fits the server's figures; a client mean far above them (a queue in front of the
    # server) is drawn at the top edge with its value, so that it does not flatten the bars.
    top = 1.6 * float(np.nanmax(np.concatenate([total, np.nan_to_num(queue) + np.nan_to_num(compute)])))
    top = max(top, float(np.nanmax(client)) * 1.1) if np.nanmax(client) < 3 * top else top
    inside = client <= top
    ax.plot(x[inside], client[inside], "D", color="tab:gray", label="client: latency (mean, ok requests)")
    for xi, value in zip(x[~inside], client[~inside], strict=True):
        ax.annotate(
            f"client {value:,.0f} ms ↑",
            (xi, top),
            xytext=(0, -14),
            textcoords="offset points",
            ha="center",
            color="tab:gray",
            fontsize="small",
        )
    ax.set_xticks(x, labels)
    ax.set_ylabel("ms")
    ax.set_ylim(0, top)
    gap = "HTTP, encoding, network" + (", waiting for a free connection" if reports[0].config.get("rate") else "")
    ax.set_title(
        f"where the time went, from the server's /metrics (client minus server total: {gap})", fontsize="medium"
    )
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncols=2, fontsize="small", frameon=False)
