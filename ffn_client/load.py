"""The load generator behind ffn-loadtest: closed or open loop, prebuilt requests, a per-request log.

Closed loop (`concurrency` workers): each sends its next request when the last answer arrives.
Open loop (`rate`): requests start at Poisson arrival times whatever the server does, and latency
counts from the scheduled start, so a slow server cannot hide its queueing (no coordinated
omission); the report says whether the rate really went on the wire. Request bodies are encoded
once up front; per request the generator only sends prebuilt bytes, reads the answer, and
appends (start, latency, status, rows, sent) to a list. /metrics is read before and after the
measured window for the server's own breakdown (server_metrics.py).

    report = await run_load(LoadConfig(url="http://127.0.0.1:8000", requests=1000, concurrency=16))
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from ffn_client.encodings import DTYPES, ENCODINGS, SUPPORTED_DTYPES
from ffn_client.payloads import discover_d_model, make_payloads
from ffn_client.report import (
    OFFERED_GRACE_S,
    TIMEOUT,
    OfferedLoad,
    Report,
    Samples,
    build_report,
    latency_stats,
    status_name,
)
from ffn_client.senders import ENGINES, Sender, note_failure
from ffn_client.server_metrics import MetricsWindow
from ffn_client.tls import client_context

DEFAULT_DURATION_S = 10.0
DEFAULT_OPEN_LOOP_CONNECTIONS = 64
DEFAULT_HTTP_PORT = 8000
GRPC_PROTOCOLS = ("grpc", "grpc-stream")
PROTOCOLS = ("http", *GRPC_PROTOCOLS)


@dataclass
class LoadConfig:
    """One load run. With neither `duration` nor `requests`, it runs for 10 s."""

    url: str = "http://127.0.0.1:8000"
    model: str = "demo"
    encoding: str = "binary"
    dtype: str = "float32"
    concurrency: int = 8  # closed loop: workers; open loop: the connection pool's size
    rate: float | None = None  # requests/s; set = open loop with Poisson arrivals
    rows: tuple[int, int] = (16, 16)  # rows per request, drawn uniformly from this range
    duration: float | None = None  # measured seconds, after the warmup
    requests: int | None = None  # measured requests, after the warmup
    warmup: float = 0.0  # seconds of load excluded from the report
    timeout: float = 30.0  # client-side, per request, seconds
    deadline_ms: float | None = None  # server-side deadline: X-Timeout-Ms, or V2 `timeout`
    api_key: str | None = None
    d_model: int | None = None  # None: asked from the server's model list
    payloads: int = 16  # distinct prebuilt request bodies, reused in turn
    seed: int = 0
    engine: str = "raw"  # "raw": lean HTTP/1.1 pool; "httpx": httpx.AsyncClient (see senders.py)
    metrics_url: str | None = None  # the server's Prometheus page; None: url + "/metrics"; "": not read
    # http: `encoding` over HTTP; grpc: unary ModelInfer calls; grpc-stream: ModelStreamInfer
    # (grpc_load.py). Over gRPC, `url` is grpc://host:port and tensors go as raw_input_contents.
    protocol: str = "http"
    # TLS: the CA that signed the server's certificate (None: the system's), and a client certificate and
    # its key for mutual TLS (`cert` may hold both). Over HTTP an https URL; over gRPC, grpcs://host:port,
    # or grpc:// with any of these.
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if self.duration is None and self.requests is None:
            self.duration = DEFAULT_DURATION_S
        problems = []
        parts = urlsplit(self.url)
        if self.protocol not in PROTOCOLS:
            problems.append(f"protocol must be one of {', '.join(PROTOCOLS)}")
        elif self.over_grpc:
            if parts.scheme not in ("grpc", "grpcs") or not parts.hostname or not parts.port or parts.path.strip("/"):
                problems.append(f"url must be grpc://host:port (grpcs:// for TLS) over gRPC, got {self.url!r}")
            if self.dtype not in DTYPES:
                problems.append(f"dtype must be one of {', '.join(DTYPES)}")
        elif parts.scheme not in ("http", "https") or not parts.hostname:
            problems.append(f"url must be http(s)://host[:port][/prefix], got {self.url!r}")
        if self.over_grpc:
            pass  # tensors go as raw_input_contents: no encoding to choose
        elif self.encoding not in ENCODINGS:
            problems.append(f"encoding must be one of {', '.join(ENCODINGS)}")
        elif self.dtype not in SUPPORTED_DTYPES[self.encoding]:
            problems.append(
                f"encoding {self.encoding} carries {', '.join(SUPPORTED_DTYPES[self.encoding])}, not {self.dtype}"
            )
        if self.key is not None and self.cert is None:
            problems.append("key needs cert: the client certificate it belongs to")
        if not self.over_grpc and parts.scheme == "http" and (self.cacert or self.cert):
            problems.append(f"cacert and cert are for TLS: use an https URL, not {self.url!r}")
        if self.engine not in ENGINES:
            problems.append(f"engine must be one of {', '.join(ENGINES)}")
        if self.concurrency < 1:
            problems.append("concurrency must be >= 1")
        if self.rate is not None and not self.rate > 0:
            problems.append("rate must be > 0")
        if not 1 <= self.rows[0] <= self.rows[1]:
            problems.append(f"rows must be a range 1 <= lo <= hi, got {self.rows}")
        if self.duration is not None and not self.duration > 0:
            problems.append("duration must be > 0")
        if self.requests is not None and self.requests < 1:
            problems.append("requests must be >= 1")
        if self.warmup < 0 or self.timeout <= 0 or self.payloads < 1:
            problems.append("warmup must be >= 0, timeout > 0 and payloads >= 1")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def over_grpc(self) -> bool:
        return self.protocol in GRPC_PROTOCOLS

    @property
    def tls(self) -> bool:
        """Whether the requests go over TLS."""
        if self.over_grpc:
            return urlsplit(self.url).scheme == "grpcs" or self.cacert is not None or self.cert is not None
        return urlsplit(self.url).scheme == "https"

    def ssl_context(self) -> ssl.SSLContext | bool:
        """httpx's `verify` for these settings: the CA and client certificate as one context, or True."""
        cert = None if self.cert is None else self.cert if self.key is None else (self.cert, self.key)
        return client_context(self.cacert or True, cert)

    @property
    def metrics_page(self) -> str | None:
        """The /metrics URL to read, or None when the server breakdown is off.

        Over gRPC, by default the same host's HTTP port, 8000 (the gRPC port serves no /metrics).
        """
        if self.metrics_url is None:
            if self.over_grpc:
                scheme = "https" if self.tls else "http"  # the server's two doors serve TLS alike
                return f"{scheme}://{urlsplit(self.url).hostname}:{DEFAULT_HTTP_PORT}/metrics"
            return self.url.rstrip("/") + "/metrics"
        return self.metrics_url or None

    def describe(self) -> dict[str, object]:
        """The settings for the report: everything but the API key."""
        out = asdict(self)
        out.pop("api_key")
        out["metrics_url"] = self.metrics_page
        lo, hi = self.rows
        out["rows"] = str(lo) if lo == hi else f"{lo}-{hi}"
        if self.over_grpc:
            out["encoding"], out["engine"] = "raw_input_contents", self.protocol
        return out


@dataclass(frozen=True)
class Progress:
    """A live view of a run, handed to the progress callback a few times a second."""

    elapsed_s: float
    warming_up: bool
    sent: int
    ok: int
    errors: int
    window_rps: float  # answered requests/s over the last window
    window_p50_ms: float
    window_p99_ms: float


class _Run:
    """The state of one run: the prebuilt requests, the bounds, and the per-request log."""

    def __init__(self, config: LoadConfig, sender: Sender[Any], payloads: list[tuple[Any, int]]) -> None:
        self.config = config
        self.sender = sender
        self.payloads = payloads
        self.log: list[tuple[float, float, int, int, float]] = []  # (start, latency, status, rows, sent)
        self.budget = float(config.requests) if config.requests is not None else math.inf
        self.started = time.perf_counter()
        self.cpu_started = time.process_time()  # the tester's own CPU, to show when it is the bottleneck
        self.measure_start = self.started + config.warmup
        self.end = self.measure_start + config.duration if config.duration is not None else math.inf
        self.last_claimed = self.measure_start  # the start of the last measured request
        self.connections = asyncio.Semaphore(config.concurrency)  # open loop: requests on the wire at once
        self.waited_for_connection = 0
        self.done = False

    def _claim(self, start: float) -> bool:
        """Whether a request starting at `start` may go: inside the duration and the budget."""
        if start >= self.end:
            return False
        if start >= self.measure_start:
            if self.budget <= 0:
                return False
            self.budget -= 1
            self.last_claimed = start
        return True

    async def closed_loop(self) -> None:
        async def worker(first: int) -> None:
            step, count = self.config.concurrency, len(self.payloads)
            i = first
            while self._claim(start := time.perf_counter()):
                request, rows = self.payloads[i % count]
                i += step
                status = await self.sender.send(request)
                self.log.append((start, time.perf_counter() - start, status, rows, start))

        await asyncio.gather(*(worker(k) for k in range(self.config.concurrency)))

    async def open_loop(self) -> None:
        assert self.config.rate is not None, "open loop without a rate. This is a bug."
        rng = random.Random(self.config.seed)
        pending: set[asyncio.Task[None]] = set()
        scheduled = time.perf_counter()
        i = 0
        while True:
            scheduled += rng.expovariate(self.config.rate)
            if not self._claim(scheduled):
                break
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(self._one(self.payloads[i % len(self.payloads)], scheduled))
            i += 1
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.wait(pending)

    async def _one(self, payload: tuple[Any, int], scheduled: float) -> None:
        """One open-loop request: wait for a free connection (the wait counts, and is counted), send."""
        request, rows = payload
        sent = math.nan
        if self.connections.locked():
            self.waited_for_connection += 1
        try:
            async with asyncio.timeout(self.config.timeout), self.connections:
                sent = time.perf_counter()
                status = await self.sender.send(request)
        except TimeoutError:  # still waiting for a connection after --timeout
            status = note_failure(
                self.sender.causes, TIMEOUT, f"no whole answer within --timeout {self.config.timeout:g} s"
            )
        self.log.append((scheduled, time.perf_counter() - scheduled, status, rows, sent))

    async def report_progress(self, progress: Callable[[Progress], None], interval: float = 0.5) -> None:
        seen, ok, errors = 0, 0, 0
        while not self.done:
            await asyncio.sleep(interval)
            now = time.perf_counter()
            window = self.log[seen:]
            seen += len(window)
            latencies = np.array([entry[1] for entry in window if entry[2] == 200])
            ok += latencies.size
            errors += len(window) - latencies.size
            stats = latency_stats(latencies)
            progress(
                Progress(
                    elapsed_s=now - self.started,
                    warming_up=now < self.measure_start,
                    sent=ok + errors,
                    ok=ok,
                    errors=errors,
                    window_rps=latencies.size / interval,
                    window_p50_ms=stats["p50"],
                    window_p99_ms=stats["p99"],
                )
            )

    def samples(self) -> tuple[Samples, int]:
        """The measured requests' samples (times relative to the measurement start), and the warmup count."""
        log = np.array(self.log, dtype=np.float64).reshape(-1, 5)
        measured = log[:, 0] >= self.measure_start
        kept = log[measured]
        samples = Samples(
            start_s=kept[:, 0] - self.measure_start,
            latency_s=kept[:, 1],
            status=kept[:, 2].astype(np.int64),
            rows=kept[:, 3].astype(np.int64),
            sent_s=kept[:, 4] - self.measure_start,
        )
        return samples, int((~measured).sum())

    def offered_load(self, samples: Samples) -> OfferedLoad:
        """How much of the open loop's schedule went on the wire before the measured window closed."""
        assert self.config.rate is not None, "offered load of a closed loop. This is a bug."
        window = max(min(self.end, self.last_claimed) - self.measure_start, 1e-9)
        lag_ms = (samples.sent_s - samples.start_s) * 1000.0
        return OfferedLoad(
            asked_rps=self.config.rate,
            window_s=window,
            scheduled=int(samples.start_s.size),
            sent_in_window=int((samples.sent_s <= window + OFFERED_GRACE_S).sum()),  # NaN (never sent) is False
            waited_for_connection=self.waited_for_connection,
            lag_p99_ms=float(np.nanpercentile(lag_ms, 99)) if np.isfinite(lag_ms).any() else math.nan,
        )


def _grpc() -> Any:
    """ffn_client.grpc_load, imported only for a gRPC run: it needs the `grpc` extra."""
    try:
        from ffn_client import grpc_load
    except ImportError as exc:
        raise ValueError(
            f"--protocol grpc needs the grpc extra: pip install './client[grpc]' (from a checkout) ({exc})"
        ) from None
    return grpc_load


def _sender(config: LoadConfig, headers: dict[str, str], verify: ssl.SSLContext | bool) -> Sender[Any]:
    if config.over_grpc:
        grpc_load = _grpc()
        tls = grpc_load.channel_tls(config) if config.tls else None
        kind = grpc_load.GrpcSender if config.protocol == "grpc" else grpc_load.GrpcStreamSender
        sender: Sender[Any] = kind(config.url, config.concurrency, config.timeout, config.api_key, tls)
        return sender
    return ENGINES[config.engine](config.url, config.concurrency, config.timeout, headers, verify)


async def run_load(config: LoadConfig, progress: Callable[[Progress], None] | None = None) -> Report:
    """Run the load `config` describes and return its report (samples included, for plots)."""
    # Uncompressed answers, as the lean engine gets: httpx would ask for gzip, which the server honours.
    headers = {
        **({"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}),
        "Accept-Encoding": "identity",
    }
    base = config.metrics_page or "" if config.over_grpc else config.url
    verify = config.ssl_context()
    async with httpx.AsyncClient(
        base_url=base, timeout=config.timeout, headers=headers, trust_env=False, verify=verify
    ) as http:
        if config.d_model is not None:
            d_model = config.d_model
        elif config.over_grpc:
            d_model = await _grpc().discover_d_model(
                _grpc().target_of(config.url),
                config.model,
                config.api_key,
                config.timeout,
                _grpc().channel_tls(config) if config.tls else None,
            )
        else:
            d_model = await discover_d_model(http, config.model)
        sender = _sender(config, headers, verify)
        payloads = [
            (sender.prepare(path, body, extra), rows) for path, body, extra, rows in make_payloads(config, d_model)
        ]
        metrics = MetricsWindow(http, config.metrics_page, config.model)
        if not config.warmup:  # the first snapshot before the measured window opens, at once
            await metrics.open(at=0.0)
        run = _Run(config, sender, payloads)
        # With a warmup, the first snapshot is taken when the window opens, during the load.
        first_scrape = asyncio.create_task(metrics.open(at=run.measure_start)) if config.warmup else None
        ticker = asyncio.create_task(run.report_progress(progress)) if progress else None
        try:
            await (run.open_loop() if config.rate is not None else run.closed_loop())
        finally:
            finished, cpu = time.perf_counter(), time.process_time() - run.cpu_started
            run.done = True
            await sender.aclose()
            for task in (ticker, first_scrape):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        samples, warmup_requests = run.samples()
        described = {**config.describe(), "d_model": d_model}
        report = build_report(described, samples, finished - run.measure_start, warmup_requests)
        report.client_cpu_s = cpu
        report.client_cpu_share = cpu / max(finished - run.started, 1e-9)
        report.error_causes = {status_name(code): cause for code, cause in sender.causes.items()}
        if config.rate is not None:
            report.offered = run.offered_load(samples)
        report.server, report.server_note = await metrics.close()
    return report
