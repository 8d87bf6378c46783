"""ffn-loadtest's tables (rich): one run's figures, or one row per step of a sweep, and what to heed."""

from __future__ import annotations

import math
from typing import Any

from ffn_client.report import PERCENTILES, Report
from ffn_client.server_metrics import Stage


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def _stage(stage: Stage) -> str:
    return f"mean {_ms(stage.mean_ms)}, p50 ~{_ms(stage.p50_ms)}, p99 ~{_ms(stage.p99_ms)}"


def _mode(cfg: dict[str, Any]) -> str:
    if cfg.get("rate"):
        return f"open loop, {cfg['rate']:g} req/s Poisson, {cfg.get('concurrency')} connections"
    return f"closed loop, concurrency {cfg.get('concurrency')}"


def run_table(report: Report) -> Any:
    """A rich Table of one run's figures, the server's breakdown, warnings and broken thresholds."""
    from rich.table import Table

    cfg = report.config
    table = Table(title="ffn-loadtest", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("target", f"{cfg.get('url')} model={cfg.get('model')}")
    table.add_row("load", _mode(cfg))
    table.add_row("encoding / dtype / rows", f"{cfg.get('encoding')} / {cfg.get('dtype')} / {cfg.get('rows')}")
    table.add_row("duration (s)", f"{report.duration_s:.2f}")
    if report.offered is not None:
        o = report.offered
        table.add_row(
            "offered (req/s)", f"{o.offered_rps:,.1f} of {o.asked_rps:g} asked", style=None if o.reached else "yellow"
        )
    table.add_row("sent / ok", f"{report.sent} / {report.ok}")
    table.add_row(
        "errors",
        ", ".join(f"{k}: {v}" for k, v in report.errors.items()) or "none",
        style="red" if report.errors else None,
    )
    table.add_row("requests/s (ok)", f"{report.requests_per_s:,.1f}")
    table.add_row("rows/s (ok)", f"{report.rows_per_s:,.0f}")
    for name in (*PERCENTILES, "max"):
        table.add_row(f"latency {name} (ms)", _ms(report.latency_ms[name]))
    if report.server is not None:
        s = report.server
        table.add_row("server queue (ms)", _stage(s.queue))
        table.add_row("server compute per batch (ms)", _stage(s.compute))
        table.add_row("server total (ms)", _stage(s.total))
        table.add_row("server rows per batch", f"{s.rows_per_batch:.1f}" if not math.isnan(s.rows_per_batch) else "-")
    else:
        table.add_row("server breakdown", "none (why: below)", style="dim")
    per_request = 1e6 * report.client_cpu_s / max(report.sent + report.warmup_requests, 1)
    table.add_row(
        "tester CPU (one core)",
        f"{report.client_cpu_share:.0%}, {per_request:.0f} µs/request",
        style="yellow" if report.client_cpu_share > 0.8 else None,
    )
    return table


def sweep_table(reports: list[Report]) -> Any:
    """A rich Table with one row per step of a sweep; broken thresholds in red, short offers in yellow."""
    from rich.table import Table

    open_loop = bool(reports and reports[0].config.get("rate"))
    cfg = reports[0].config if reports else {}
    table = Table(
        title=f"ffn-loadtest sweep: {cfg.get('url')} model={cfg.get('model')}, "
        f"{cfg.get('encoding')}/{cfg.get('dtype')}, rows {cfg.get('rows')}"
    )
    columns = ["rate", "offered"] if open_loop else ["conc."]
    columns += [
        "ok req/s",
        "rows/s",
        "p50",
        "p90",
        "p99",
        "max",
        "errors",
        "queue",
        "compute",
        "total",
        "rows/ batch",
        "tester CPU",
    ]
    for name in columns:
        table.add_column(name, justify="right")
    for r in reports:
        cells = (
            [f"{r.config['rate']:g}", f"{r.offered.offered_rps:,.1f}" if r.offered else "-"]
            if open_loop
            else [str(r.config.get("concurrency"))]
        )
        s = r.server
        cells += [
            f"{r.requests_per_s:,.1f}",
            f"{r.rows_per_s:,.0f}",
            *(_ms(r.latency_ms[k]) for k in ("p50", "p90", "p99", "max")),
            f"{r.sent - r.ok} ({r.error_rate:.1%})" if r.sent - r.ok else "0",
            _ms(s.queue.mean_ms) if s else "-",
            _ms(s.compute.mean_ms) if s else "-",
            _ms(s.total.mean_ms) if s else "-",
            f"{s.rows_per_batch:.1f}" if s and not math.isnan(s.rows_per_batch) else "-",
            f"{r.client_cpu_share:.0%}",
        ]
        style = "red" if r.breaches else "yellow" if r.offered is not None and not r.offered.reached else None
        table.add_row(*cells, style=style)
    table.caption = (
        ("rate, offered: req/s. " if open_loop else "") + "p50 ... max: client-side latency of the ok requests, ms. "
        "queue, compute (per batch), total, rows/batch: the server's means from /metrics, ms"
    )
    return table


def notes(reports: list[Report]) -> list[tuple[str, str]]:
    """(style, line) for everything a reader must not miss: errors and their causes, warnings, breaches."""
    out: list[tuple[str, str]] = []
    sweep = len(reports) > 1
    for r in reports:
        where = f"{r.label}: " if sweep else ""
        for key, cause in r.error_causes.items():
            out.append(("red", f"{where}{key} x{r.errors.get(key, 0)}: {cause}"))
        out += [("yellow", f"{where}warning: {w}") for w in r.warnings()]
        if r.server is None and (r is reports[0] or r.server_note != reports[0].server_note):
            out.append(("dim", f"{where}no server breakdown: {r.server_note}"))
        out += [("red", f"{where}threshold broken: {b}") for b in r.breaches]
    return out
