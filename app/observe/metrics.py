"""The service's Prometheus instruments, one registry per app (so tests can run several apps).

With worker processes (prometheus_client's multiprocess mode: PROMETHEUS_MULTIPROC_DIR set before
the process imported prometheus_client), each worker's instruments write to files in that folder,
and `Metrics.merged` reads every worker's files, live or dead: counters and histograms add up,
each gauge merges as its `multiprocess_mode` says. One process: `merged` is `registry` itself.
"""

from __future__ import annotations

import bisect
import os
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from app.observe.collectors import BuildInfoCollector, GpuMemoryCollector, GpuReading, ProcessesCollector, read_gpus

if TYPE_CHECKING:
    from app.observe.triton_metrics import TritonNames

MULTIPROCESS_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"

# The *_created series double the page for no use in dashboards.
disable_created_metrics()

# Latency buckets from 100 µs to 10 s: a single-row CPU pass is ~0.1 ms, a deadline is seconds.
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# A load takes from tens of milliseconds (a small FFN on the CPU) to minutes (a large one read from a slow disk).
LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# ffn_model_loads_total's model label for every load of a name no [[models]] table names (a load
# refused for a name a client made up): one value for all of them, so refusals never add series.
# No model can have it: a name starts with a letter or a digit.
OTHER_MODELS = "(other)"
LOAD_OUTCOMES = ("ok", "failed")


# Samples that are a moment, not an amount: a model's figure is the latest of them, not their sum.
LATEST_SAMPLES = frozenset({"ffn_last_inference_timestamp_seconds"})


def samples_by_model(families: Iterable[Metric]) -> defaultdict[str, defaultdict[str, float]]:
    """model -> sample name (`ffn_queue_seconds_sum`, ...) -> value: summed over every other label
    (outcome, protocol, and with workers each worker's), but the latest for a moment. Buckets are left out."""
    by_model: defaultdict[str, defaultdict[str, float]] = defaultdict(lambda: defaultdict(float))
    for family in families:
        for sample in family.samples:
            model = sample.labels.get("model")
            if model is None or sample.name.endswith("_bucket"):
                continue
            values = by_model[model]
            if sample.name in LATEST_SAMPLES:
                values[sample.name] = max(values[sample.name], sample.value)
            else:
                values[sample.name] += sample.value
    return by_model


def multiprocess_folder() -> Path | None:
    """The folder shared by the worker processes' metrics, or None in a single process."""
    folder = os.environ.get(MULTIPROCESS_VARIABLE)
    return Path(folder) if folder else None


def observe_many(histogram: Histogram, values: Sequence[float]) -> None:
    """Observe every value of `values` in a histogram's child, as as many `observe` calls would, in one pass.

    Per batch instead of per request: each `observe` takes the value's lock twice and walks the
    buckets in Python (some 2 µs); here the buckets' counts are found together and each bucket
    touched once. Reads prometheus_client's Histogram members (`_upper_bounds`, `_buckets`,
    `_sum`), which tests/test_metrics.py checks against plain `observe` calls.
    """
    if not values:
        return
    bounds: list[float] = histogram._upper_bounds
    counts = [0] * len(bounds)
    for value in values:
        counts[bisect.bisect_left(bounds, value)] += 1
    buckets = histogram._buckets
    for index, count in enumerate(counts):
        if count:
            buckets[index].inc(count)
    histogram._sum.inc(sum(values))


@dataclass
class Metrics:
    """Named instruments (labelled by model), and `merged`: what a scrape shows.

    `registry` holds this process's instruments. `merged` is the whole service: the instruments
    of every worker, plus the build, the processes and GPU memory, read at collection time. Read
    `merged` (e.g. `merged.collect()` once, or `merged.get_sample_value(name, labels)`) for
    figures about the service; with workers, `registry` alone is one worker's share.
    """

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    # Triton's names (nv_inference_*, nv_gpu_*) written after the ffn_* series; None: off (triton_metrics).
    triton: TritonNames | None = None
    # The GPUs the service computes on, read at a scrape (ffn_gpu_memory_*, nv_gpu_*): this process's,
    # or, in a front of engine processes, what they last reported (app/handoff/remote.py).
    gpus: Callable[[], list[GpuReading]] = read_gpus

    # Names forgotten (a model no [[models]] table names any more, unloaded): their series are left
    # out of every scrape. With workers, prometheus_client keeps every series written in the
    # folder's files, live or dead, whatever this process removes: a scrape leaves them out.
    hidden: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        r = self.registry
        folder = multiprocess_folder()
        if folder is None:
            self.merged = r
        else:
            self.merged = CollectorRegistry()
            MultiProcessCollector(self.merged, path=str(folder))
        for collector in (BuildInfoCollector(), ProcessesCollector(folder), GpuMemoryCollector(lambda: self.gpus())):
            self.merged.register(collector)
        self.requests = Counter(
            "ffn_requests",
            "Requests answered, by model, outcome and protocol (http, grpc).",
            ["model", "outcome", "protocol"],
            registry=r,
        )
        self.queue_seconds = Histogram(
            "ffn_queue_seconds",
            "Time an entry waited in the queue before its batch started.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.compute_seconds = Histogram(
            "ffn_compute_seconds",
            "Time of one batch's forward pass, host copies included.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "ffn_request_seconds",
            "Time from a request's arrival at the batcher to its answer.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # For the V2 statistics extension (Triton's shape): what the instruments above cannot give.
        # Triton counts compute time per request (each request its batch's whole pass), failed
        # requests with their durations, and the time of the last inference.
        self.request_compute_seconds = Counter(
            "ffn_request_compute_seconds",
            "Forward-pass time summed over requests: each request in a batch counts the batch's whole pass.",
            ["model"],
            registry=r,
        )
        self.failed_request_seconds = Histogram(
            "ffn_failed_request_seconds",
            "Time from a request's arrival at the batcher to its failure "
            "(queue full, deadline passed, client gone, model error, shutdown).",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.last_inference = Gauge(
            "ffn_last_inference_timestamp_seconds",
            "When the model last finished a forward pass (Unix time).",
            ["model"],
            registry=r,
            multiprocess_mode="max",
        )
        self.batch_rows = Histogram(
            "ffn_batch_rows", "Rows in each forward pass.", ["model"], buckets=ROW_BUCKETS, registry=r
        )
        self.request_rows = Histogram(
            "ffn_request_rows",
            "Rows in each request the batcher accepted.",
            ["model"],
            buckets=ROW_BUCKETS,
            registry=r,
        )
        # With workers: the rows waiting in all of them, and the lowest ceiling any of them has.
        self.queue_rows = Gauge(
            "ffn_queue_rows",
            "Work waiting in the queue, in rows (a Monte Carlo request counts rows x passes).",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.batch_ceiling = Gauge(
            "ffn_max_batch_rows",
            "Current batch size ceiling (lowered after out-of-memory).",
            ["model"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self.oom_splits = Counter(
            "ffn_oom_splits", "Batches split in halves after running out of memory.", ["model"], registry=r
        )
        # With workers: how many live workers hold the model in each state.
        self.model_state = Gauge(
            "ffn_model_state",
            "1 for the model's current state (LOADING, READY, UNAVAILABLE), 0 for the others; summed over workers.",
            ["model", "state"],
            registry=r,
            multiprocess_mode="livesum",
        )
        # Explicit model control (app/engine/lifecycle.py). Loads are counted where they are
        # applied: with workers, a load that every worker applies counts once per worker.
        self.model_version = Gauge(
            "ffn_model_version",
            "The version of the model served (0: unloaded); with workers, the lowest any live worker serves.",
            ["model"],
            registry=r,
            multiprocess_mode="livemin",
        )
        # The identity of what each model serves: 1 per (model, version, digest) served now. With
        # workers, 1 where any live worker serves it: two digests at 1 for one model is a mix.
        self.model_info = Gauge(
            "ffn_model_info",
            "1 for the version and digest (sha256 of the weights and their table) each model serves; "
            "with workers, 1 where any live worker serves it.",
            ["model", "version", "digest"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.model_loads = Counter(
            "ffn_model_loads",
            "Loads and reloads while serving, by outcome (ok, failed): a load refused before any worker read "
            "its file counts once, one applied counts in each worker; a name no [[models]] table names is "
            f"counted as {OTHER_MODELS!r}.",
            ["model", "outcome"],
            registry=r,
        )
        self.model_load_seconds = Histogram(
            "ffn_model_load_seconds",
            "From a load's start to its copy serving: read, build, warm-up and switch.",
            ["model"],
            buckets=LOAD_BUCKETS,
            registry=r,
        )
        # Whole HTTP requests, as users see them (the histograms above start at the batcher). The
        # route is the endpoint's template, never the raw path, so the series stay bounded.
        self.http_request_seconds = Histogram(
            "ffn_http_request_seconds",
            "Whole HTTP requests at the ASGI edge, from the parsed head to the last byte of the answer, "
            "by protocol, route template and status class.",
            ["protocol", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.worker_restarts = Counter(
            "ffn_worker_restarts", "Worker processes started to replace one that died.", registry=r
        )
        # Every instrument with a model label: what a forgotten model leaves.
        self.by_model: tuple[Counter | Gauge | Histogram, ...] = (
            self.requests,
            self.queue_seconds,
            self.compute_seconds,
            self.request_seconds,
            self.request_compute_seconds,
            self.failed_request_seconds,
            self.last_inference,
            self.batch_rows,
            self.request_rows,
            self.queue_rows,
            self.batch_ceiling,
            self.oom_splits,
            self.model_state,
            self.model_version,
            self.model_info,
            self.model_loads,
            self.model_load_seconds,
        )

    def loads_from_zero(self, model: str) -> None:
        """Create `model`'s load series at 0, so that `increase()` sees its first failed load (an alert on it fires)."""
        for outcome in LOAD_OUTCOMES:
            self.model_loads.labels(model=model, outcome=outcome)
        self.model_load_seconds.labels(model=model)

    def forget_model(self, model: str) -> None:
        """`model` is no longer a model of the service: its series go, and no scrape shows them from now on."""
        self.hidden.add(model)
        with warnings.catch_warnings():
            # "not implemented in multi-process mode": the files keep the values; render leaves them out.
            warnings.simplefilter("ignore", UserWarning)
            for instrument in self.by_model:
                instrument.remove_by_labels({"model": model})

    def remember_model(self, model: str) -> None:
        """`model` is a model of the service again (a table names it, a load serves it): scrapes show it."""
        self.hidden.discard(model)

    def render(self) -> bytes:
        """The Prometheus text of `merged`, then Triton's names of the same samples when they are on."""
        families = list(self.merged.collect())  # read once: with workers, every worker's files
        if self.hidden:
            for family in families:
                family.samples = [s for s in family.samples if s.labels.get("model") not in self.hidden]
        text = generate_latest(_Collected(families))
        if self.triton is None:
            return text
        return text + self.triton.render(families).encode()

    def for_model(self, model: str) -> ModelInstruments:
        """The instruments with the model's label bound once (a label lookup per use costs µs)."""
        return ModelInstruments(
            queue_seconds=self.queue_seconds.labels(model=model),
            compute_seconds=self.compute_seconds.labels(model=model),
            request_seconds=self.request_seconds.labels(model=model),
            request_compute_seconds=self.request_compute_seconds.labels(model=model),
            failed_request_seconds=self.failed_request_seconds.labels(model=model),
            last_inference=self.last_inference.labels(model=model),
            batch_rows=self.batch_rows.labels(model=model),
            request_rows=self.request_rows.labels(model=model),
            queue_rows=self.queue_rows.labels(model=model),
            batch_ceiling=self.batch_ceiling.labels(model=model),
            oom_splits=self.oom_splits.labels(model=model),
        )


class _Collected(Collector):
    """Families already collected, as generate_latest reads a registry."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


@dataclass(frozen=True)
class ModelInstruments:
    """One model's labelled children of the Metrics instruments."""

    queue_seconds: Histogram
    compute_seconds: Histogram
    request_seconds: Histogram
    request_compute_seconds: Counter
    failed_request_seconds: Histogram
    last_inference: Gauge
    batch_rows: Histogram
    request_rows: Histogram
    queue_rows: Gauge
    batch_ceiling: Gauge
    oom_splits: Counter
