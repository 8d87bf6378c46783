"""The server's own view of a load run: queue, compute and total time, from /metrics before and after.

ffn-serve keeps Prometheus histograms per model: `ffn_queue_seconds` (each request's wait for its
batch), `ffn_compute_seconds` (each batch's forward pass), `ffn_request_seconds` (each request,
from the batcher taking it to its answer) and `ffn_batch_rows` (rows per forward pass). Scraping
before and after the measured window and subtracting gives them over that window: exact means
(sum / count) and percentiles estimated from the buckets the way PromQL's histogram_quantile does,
so never finer than a bucket. The text is read with prometheus_client's parser.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

import httpx

from ffn_client.errors import error_from_response

STAGES = {"queue": "ffn_queue_seconds", "compute": "ffn_compute_seconds", "total": "ffn_request_seconds"}
BATCH_ROWS = "ffn_batch_rows"


class MetricsUnavailable(Exception):
    """No server breakdown: the message says why (unreachable, refused, not ffn-serve's metrics...)."""


@dataclass(frozen=True)
class Histogram:
    """One model's histogram, summed over its other labels (workers, replicas): buckets, count, sum."""

    bounds: tuple[float, ...]  # bucket upper bounds, ascending, +Inf last
    cumulative: tuple[float, ...]  # observations <= each bound
    count: float
    sum: float

    def minus(self, earlier: Histogram) -> Histogram:
        """The observations made since `earlier`; MetricsUnavailable if the counters went back (a restart)."""
        if earlier.bounds != self.bounds:
            raise MetricsUnavailable("the histogram's buckets changed between the two scrapes")
        if self.count < earlier.count:
            raise MetricsUnavailable("the server's counters went back during the run (a restart?)")
        return Histogram(
            self.bounds,
            tuple(a - b for a, b in zip(self.cumulative, earlier.cumulative, strict=True)),
            self.count - earlier.count,
            self.sum - earlier.sum,
        )

    def quantile(self, q: float) -> float:
        """The q-quantile by linear interpolation inside its bucket (PromQL histogram_quantile); NaN if empty."""
        total = self.cumulative[-1] if self.cumulative else 0.0
        if total <= 0:
            return math.nan
        rank = q * total
        for i, (bound, below_or_at) in enumerate(zip(self.bounds, self.cumulative, strict=True)):
            if below_or_at >= rank:
                if math.isinf(bound):  # in the +Inf bucket: the highest finite bound is all one knows
                    return self.bounds[i - 1] if i else math.nan
                lower, before = (self.bounds[i - 1], self.cumulative[i - 1]) if i else (0.0, 0.0)
                inside = below_or_at - before
                return lower + (bound - lower) * ((rank - before) / inside if inside else 1.0)
        return math.nan


@dataclass(frozen=True)
class Stage:
    """One stage's figures over the window, in milliseconds."""

    count: int
    mean_ms: float
    p50_ms: float
    p99_ms: float

    @classmethod
    def of(cls, h: Histogram) -> Stage:
        mean = 1000.0 * h.sum / h.count if h.count else math.nan
        return cls(int(h.count), mean, 1000.0 * h.quantile(0.5), 1000.0 * h.quantile(0.99))


@dataclass(frozen=True)
class ServerBreakdown:
    """Where a request's time went inside the server: queue and total per request, compute per batch."""

    queue: Stage
    compute: Stage  # per forward pass: one batch serves many requests
    total: Stage
    rows_per_batch: float

    def to_dict(self) -> dict[str, Any]:
        def figures(stage: Stage) -> dict[str, Any]:
            return {"count": stage.count, **{k: _ms(getattr(stage, k)) for k in ("mean_ms", "p50_ms", "p99_ms")}}

        return {
            "queue": figures(self.queue),
            "compute_per_batch": figures(self.compute),
            "total": figures(self.total),
            "rows_per_batch": _ms(self.rows_per_batch),
        }


def _ms(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


Snapshot = dict[str, Histogram]  # metric name -> the model's histogram


def parse_snapshot(text: str, model: str) -> Snapshot:
    """The model's histograms of STAGES and BATCH_ROWS from Prometheus text (absent ones left out)."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError as exc:
        raise MetricsUnavailable(
            f"reading /metrics needs prometheus-client: pip install './client[loadtest]' (from a checkout) ({exc})"
        ) from exc
    wanted = {*STAGES.values(), BATCH_ROWS}
    buckets: dict[str, dict[float, float]] = {}
    totals: dict[str, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name not in wanted:
                continue
            for sample in family.samples:
                if sample.labels.get("model") != model:
                    continue
                suffix = sample.name.removeprefix(family.name)
                if suffix == "_bucket":
                    by_bound = buckets.setdefault(family.name, {})
                    bound = float(sample.labels["le"])
                    by_bound[bound] = by_bound.get(bound, 0.0) + sample.value
                elif suffix in ("_count", "_sum"):
                    sums = totals.setdefault(family.name, {})
                    sums[suffix] = sums.get(suffix, 0.0) + sample.value
    except (ValueError, KeyError, IndexError) as exc:
        raise MetricsUnavailable(f"not Prometheus text: {type(exc).__name__}: {exc}") from exc
    out = {}
    for name, by_bound in buckets.items():
        bounds = tuple(sorted(by_bound))
        sums = totals.get(name, {})
        out[name] = Histogram(
            bounds, tuple(by_bound[b] for b in bounds), sums.get("_count", 0.0), sums.get("_sum", 0.0)
        )
    return out


async def scrape(http: httpx.AsyncClient, url: str, model: str) -> Snapshot:
    """GET `url` (a /metrics page) and parse the model's histograms; MetricsUnavailable says why not."""
    try:
        response = await http.get(url)
    except httpx.HTTPError as exc:
        raise MetricsUnavailable(f"GET {url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        error = error_from_response(response.status_code, response.headers, response.content)
        raise MetricsUnavailable(f"GET {url}: {error}")
    return parse_snapshot(response.text, model)


def breakdown(before: Snapshot, after: Snapshot, model: str) -> ServerBreakdown:
    """The figures between two snapshots; MetricsUnavailable when the page lacks the model's histograms."""
    missing = [name for name in STAGES.values() if name not in after]
    if missing:
        raise MetricsUnavailable(
            f"the metrics have no {', '.join(missing)} for model {model!r}: not ffn-serve's /metrics?"
        )
    stages = {}
    for stage, name in STAGES.items():
        window = after[name].minus(before[name]) if name in before else after[name]
        stages[stage] = Stage.of(window)
    rows = after.get(BATCH_ROWS)
    if rows is not None and BATCH_ROWS in before:
        rows = rows.minus(before[BATCH_ROWS])
    rows_per_batch = rows.sum / rows.count if rows is not None and rows.count else math.nan
    return ServerBreakdown(stages["queue"], stages["compute"], stages["total"], rows_per_batch)


class MetricsWindow:
    """The snapshots of a load run's measured window: one when it opens, one after the run."""

    def __init__(self, http: httpx.AsyncClient, url: str | None, model: str) -> None:
        self.http, self.url, self.model = http, url, model
        self.first: Snapshot | None = None
        self.note: str | None = None if url else "not read (--metrics-url '')"

    async def open(self, at: float) -> None:
        """Take the first snapshot at `at` (a time.perf_counter value): the end of the warmup."""
        if self.url is None:
            return
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        try:
            self.first = await scrape(self.http, self.url, self.model)
        except MetricsUnavailable as exc:
            self.note = str(exc)

    async def close(self) -> tuple[ServerBreakdown | None, str | None]:
        """The breakdown over the window, or None and the reason there is none."""
        if self.url is None or self.first is None:
            return None, self.note or "the run ended before the measured window opened"
        try:
            return breakdown(self.first, await scrape(self.http, self.url, self.model), self.model), None
        except MetricsUnavailable as exc:
            return None, str(exc)
