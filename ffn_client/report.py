"""A load run's results: counts, throughput, latency percentiles, the checks on them; as JSON or a CSV row.

numpy only at import. The tables are in tables.py (rich), the plots in plots.py (matplotlib).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ffn_client.server_metrics import ServerBreakdown

PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p99.9": 99.9}
# Negative status codes stand for requests that got no HTTP answer at all.
TIMEOUT, CONNECT_ERROR, TRANSPORT_ERROR = -1, -2, -3
NO_ANSWER = {TIMEOUT: "timeout", CONNECT_ERROR: "connect", TRANSPORT_ERROR: "transport"}
# An open loop that put less than this share of its schedule on the wire in its window is flagged;
# a request sent this long after the window closed still counts (the last one of a --requests run).
OFFERED_SHARE_REQUIRED = 0.95
OFFERED_GRACE_S = 0.02


@dataclass
class Samples:
    """One entry per measured request: start (s from the measurement start), latency, status, rows.

    `start_s` is when the request was due: the send in a closed loop, the scheduled arrival in an
    open one; `sent_s` is when it went on the wire (later when it waited for a connection), NaN if never.
    """

    start_s: np.ndarray
    latency_s: np.ndarray
    status: np.ndarray
    rows: np.ndarray
    sent_s: np.ndarray

    @property
    def ok(self) -> np.ndarray:
        return self.status == 200


@dataclass(frozen=True)
class OfferedLoad:
    """Whether an open loop put its rate on the wire: requests counted over the measured window."""

    asked_rps: float  # --rate
    window_s: float  # the measured window of the schedule
    scheduled: int  # requests the Poisson schedule placed in the window
    sent_in_window: int  # of them, those on the wire by the window's end (plus OFFERED_GRACE_S)
    waited_for_connection: int  # requests that found every connection busy
    lag_p99_ms: float  # scheduled arrival to going on the wire, p99

    @property
    def offered_rps(self) -> float:
        return self.sent_in_window / self.window_s

    @property
    def reached(self) -> bool:
        return self.sent_in_window >= OFFERED_SHARE_REQUIRED * self.scheduled

    def to_dict(self) -> dict[str, Any]:
        return {
            "asked_rps": self.asked_rps,
            "offered_rps": round(self.offered_rps, 2),
            "reached": self.reached,
            "scheduled": self.scheduled,
            "sent_in_window": self.sent_in_window,
            "waited_for_connection": self.waited_for_connection,
            "lag_p99_ms": round(self.lag_p99_ms, 3),
        }


@dataclass(frozen=True)
class Thresholds:
    """Pass/fail limits on every run (k6's thresholds): breaking one sets the exit status."""

    max_p99_ms: float | None = None
    max_error_rate: float | None = None  # failed / sent, 0..1

    def breaches(self, report: Report) -> list[str]:
        """What `report` broke, one sentence each; empty when it passed."""
        out = []
        p99 = report.latency_ms["p99"]
        if self.max_p99_ms is not None and not p99 <= self.max_p99_ms:  # NaN (nothing succeeded) breaks it too
            out.append(f"p99 {p99:.2f} ms > --max-p99-ms {self.max_p99_ms:g}")
        if self.max_error_rate is not None and report.error_rate > self.max_error_rate:
            out.append(f"error rate {report.error_rate:.2%} > --max-error-rate {self.max_error_rate:.2%}")
        return out


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
    error_causes: dict[str, str] = field(default_factory=dict)  # errors' key -> the first reason seen
    offered: OfferedLoad | None = None  # open loop only
    server: ServerBreakdown | None = None  # from /metrics before and after
    server_note: str | None = None  # why there is no server breakdown
    breaches: list[str] = field(default_factory=list)  # thresholds broken
    samples: Samples | None = field(default=None, repr=False)

    @property
    def error_rate(self) -> float:
        return (self.sent - self.ok) / self.sent if self.sent else 0.0

    @property
    def label(self) -> str:
        """The run's place in a sweep: its concurrency (closed loop) or its rate (open loop)."""
        rate = self.config.get("rate")
        return f"{rate:g}/s" if rate else f"c={self.config.get('concurrency')}"

    def warnings(self) -> list[str]:
        """What makes the figures mean less than they seem, one sentence each."""
        out = []
        if self.offered is not None and not self.offered.reached:
            o = self.offered
            why = (
                f"{o.waited_for_connection} requests found all {self.config.get('concurrency')} connections busy: "
                "the server answered slower than the rate (raise --concurrency to offer it anyway)"
                if o.waited_for_connection
                else f"the tester fell behind its own schedule (it used {self.client_cpu_share:.0%} of one core)"
            )
            out.append(
                f"asked for {o.asked_rps:g} req/s but offered {o.offered_rps:,.1f} req/s: "
                f"{o.scheduled - o.sent_in_window} of {o.scheduled} requests went out after the window; {why}"
            )
        if self.client_cpu_share > 0.8:
            out.append(
                f"the tester used {self.client_cpu_share:.0%} of one core: the figures may describe the tester, not the server"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        """The machine-readable report (no per-request samples)."""
        out: dict[str, Any] = {
            "config": self.config,
            "duration_s": round(self.duration_s, 4),
            "counts": {"sent": self.sent, "ok": self.ok, "errors": self.errors},
            "error_causes": self.error_causes,
            "rows_ok": self.rows_ok,
            "requests_per_s": round(self.requests_per_s, 2),
            "rows_per_s": round(self.rows_per_s, 2),
            "latency_ms": {k: _round(v) for k, v in self.latency_ms.items()},
            "warmup_requests": self.warmup_requests,
            "client_cpu": {
                "seconds": round(self.client_cpu_s, 4),
                "share_of_one_core": round(self.client_cpu_share, 4),
                "us_per_request": round(1e6 * self.client_cpu_s / max(self.sent + self.warmup_requests, 1), 2),
            },
            "server": self.server.to_dict() if self.server else {"unavailable": self.server_note},
            "warnings": self.warnings(),
            "breaches": self.breaches,
        }
        if self.offered is not None:
            out["open_loop"] = self.offered.to_dict()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def csv_row(self) -> dict[str, Any]:
        """The run as one flat CSV row (CSV_COLUMNS); empty cells where a figure does not apply."""
        o, s = self.offered, self.server
        row: dict[str, Any] = {
            "mode": "open" if self.config.get("rate") else "closed",
            "concurrency": self.config.get("concurrency"),
            "rate": self.config.get("rate") or "",
            "offered_rps": round(o.offered_rps, 2) if o else "",
            "duration_s": round(self.duration_s, 3),
            "sent": self.sent,
            "ok": self.ok,
            "errors": self.sent - self.ok,
            "error_rate": round(self.error_rate, 6),
            "requests_per_s": round(self.requests_per_s, 2),
            "rows_per_s": round(self.rows_per_s, 1),
            **{f"{k}_ms": _round(self.latency_ms[k]) for k in (*PERCENTILES, "max", "mean")},
            "tester_cpu_share": round(self.client_cpu_share, 4),
            "passed": not self.breaches,
        }
        for stage in ("queue", "compute", "total"):
            figures = getattr(s, stage) if s else None
            for stat in ("mean", "p50", "p99"):
                row[f"server_{stage}_{stat}_ms"] = _round(getattr(figures, f"{stat}_ms")) if figures else ""
        row["server_rows_per_batch"] = round(s.rows_per_batch, 2) if s else ""
        return row


CSV_COLUMNS = [
    "mode",
    "concurrency",
    "rate",
    "offered_rps",
    "duration_s",
    "sent",
    "ok",
    "errors",
    "error_rate",
    "requests_per_s",
    "rows_per_s",
    *(f"{k}_ms" for k in (*PERCENTILES, "max", "mean")),
    "tester_cpu_share",
    "passed",
    *(f"server_{stage}_{stat}_ms" for stage in ("queue", "compute", "total") for stat in ("mean", "p50", "p99")),
    "server_rows_per_batch",
]


def _round(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


def latency_stats(latency_s: np.ndarray) -> dict[str, float]:
    """Percentiles, max and mean in milliseconds; NaN when there are no samples."""
    if latency_s.size == 0:
        return {name: float("nan") for name in (*PERCENTILES, "max", "mean")}
    ms = latency_s * 1000.0
    stats = dict(zip(PERCENTILES, (float(v) for v in np.percentile(ms, list(PERCENTILES.values()))), strict=True))
    stats["max"] = float(ms.max())
    stats["mean"] = float(ms.mean())
    return stats


def status_name(status: int) -> str:
    """The errors' key of a status: '429', '503', ..., or 'timeout', 'connect', 'transport'."""
    return NO_ANSWER.get(status, str(status))


def error_counts(status: np.ndarray) -> dict[str, int]:
    """Failed requests by status: '429', '503', ..., 'timeout', 'connect', 'transport'."""
    codes, counts = np.unique(status[status != 200], return_counts=True)
    return {status_name(int(c)): int(n) for c, n in zip(codes, counts, strict=True)}


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


def window_stats(samples: Samples, window_s: float = 1.0) -> dict[str, np.ndarray]:
    """Per window of start time: its start, ok requests/s and latency percentiles (ms)."""
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
