"""ffn-loadtest: closed- or open-loop HTTP or gRPC load against an ffn-serve model, one run or a sweep.

    ffn-loadtest --requests 2000 --concurrency 16 --rows 1-300 --plot out.png --json -
    ffn-loadtest --concurrency-range 1:64:x2 --duration 10 --csv sweep.csv --plot sweep.png --max-p99-ms 50
    ffn-loadtest --protocol grpc --url grpc://127.0.0.1:8001 --concurrency 16 --duration 10

Exit status: 0 every run measured and every threshold held; 1 nothing could be measured (the
target unreachable, the model unknown, not one request answered 200); 2 bad arguments, the
load-test extra missing, or an output file that cannot be written; 99 a threshold broken (k6's
code for it). The generator is
`ffn_client.load` (`run_load`, `LoadConfig`), the sweep `ffn_client.sweep`, usable in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ffn_client import __version__
from ffn_client.encodings import DTYPES, ENCODINGS
from ffn_client.load import (
    DEFAULT_DURATION_S,
    DEFAULT_OPEN_LOOP_CONNECTIONS,
    PROTOCOLS,
    LoadConfig,
    Progress,
    run_load,
)
from ffn_client.report import Report, Thresholds
from ffn_client.senders import ENGINES
from ffn_client.sweep import parse_range, run_sweep, write_csv

if TYPE_CHECKING:  # rich is imported when the CLI runs, not when this module is imported
    from rich.console import Console

__all__ = ["LoadConfig", "Progress", "Report", "build_parser", "main", "run_load"]

EXIT_OK, EXIT_NOT_MEASURED, EXIT_USAGE, EXIT_THRESHOLD = 0, 1, 2, 99
DEFAULT_URLS = {
    "http": "http://127.0.0.1:8000",
    "grpc": "grpc://127.0.0.1:8001",
    "grpc-stream": "grpc://127.0.0.1:8001",
}


def _rows(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"rows must be N or LO-HI, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"rows must satisfy 1 <= LO <= HI, got {text!r}")
    return bounds


def _range(integer: bool) -> Callable[[str], list[float]]:
    def parse(text: str) -> list[float]:
        try:
            return parse_range(text, integer=integer)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _share(text: str) -> float:
    """An error rate: 0.01 or 1%."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"an error rate is a fraction (0.01) or a percentage (1%), got {text!r}"
        ) from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"an error rate is between 0 and 1 (0% and 100%), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ffn-loadtest",
        description="Load an ffn-serve model over HTTP or gRPC and report throughput, latency percentiles and the "
        "server's own breakdown; one run, or a sweep over concurrency or rate.",
        epilog="exit status: 0 passed, 1 nothing measured (unreachable, unknown model, no 200), "
        "2 bad arguments, 99 a threshold broken",
    )
    parser.add_argument("--version", action="version", version=f"ffn-loadtest {__version__}")
    target = parser.add_argument_group("target")
    target.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="http",
        help="http (default); grpc: unary ModelInfer calls; grpc-stream: ModelStreamInfer, one request at a time "
        "on each of up to --concurrency streams (both need the grpc extra)",
    )
    target.add_argument(
        "--url",
        help=f"server base URL (default {DEFAULT_URLS['http']}; with --protocol grpc or grpc-stream, the gRPC "
        f"address, default {DEFAULT_URLS['grpc']})",
    )
    target.add_argument("--model", default="demo", help="model name (default %(default)s)")
    target.add_argument("--encoding", choices=ENCODINGS, default="binary", help="wire encoding (default %(default)s)")
    target.add_argument("--dtype", choices=DTYPES, default="float32", help="wire dtype (default %(default)s)")
    target.add_argument("--api-key", default=os.environ.get("FFN_API_KEY"), help="Bearer key (default $FFN_API_KEY)")
    target.add_argument("--d-model", type=int, help="skip asking the server for the model's d_model")
    target.add_argument(
        "--cacert",
        metavar="FILE",
        help="TLS: the CA (PEM) that signed the server's certificate (default: the system's); over gRPC it turns "
        "TLS on, as a grpcs:// URL does",
    )
    target.add_argument(
        "--cert", metavar="FILE", help="mutual TLS: the client certificate (PEM; it may hold the key too, as curl's)"
    )
    target.add_argument("--key", metavar="FILE", help="mutual TLS: the client certificate's key (PEM)")
    target.add_argument(
        "--metrics-url", help="Prometheus page for the server breakdown (default URL/metrics; '' = none)"
    )
    load = parser.add_argument_group("load (one run)")
    load.add_argument(
        "-c",
        "--concurrency",
        type=int,
        help=f"closed loop: concurrent workers (default 8); with --rate or --rate-range: "
        f"most connections (default {DEFAULT_OPEN_LOOP_CONNECTIONS})",
    )
    load.add_argument("-r", "--rate", type=float, help="open loop: Poisson arrivals at this many requests/s")
    sweep = parser.add_argument_group("sweep (one run per step, each with the bounds below)")
    sweep.add_argument(
        "--concurrency-range",
        type=_range(True),
        metavar="START:END:STEP",
        help="closed loop at each concurrency; STEP +N or xN (1:64:x2 = 1, 2, 4, ..., 64)",
    )
    sweep.add_argument(
        "--rate-range",
        "--request-rate-range",
        type=_range(False),
        metavar="START:END:STEP",
        help="open loop at each rate, requests/s (100:500:100)",
    )
    bounds = parser.add_argument_group("bounds (of each run)")
    bounds.add_argument(
        "--rows", type=_rows, default=(16, 16), help="rows per request, N or LO-HI uniform (default 16)"
    )
    bounds.add_argument(
        "-d",
        "--duration",
        type=float,
        help=f"measured seconds (default {DEFAULT_DURATION_S:g} when --requests is not given)",
    )
    bounds.add_argument(
        "-n",
        "--requests",
        type=int,
        help="measured requests; stops at whichever of --duration and --requests comes first",
    )
    bounds.add_argument(
        "--warmup", type=float, default=0.0, help="seconds of load before measuring, excluded from the report"
    )
    bounds.add_argument(
        "--timeout", type=float, default=30.0, help="client-side timeout per request, seconds (default %(default)s)"
    )
    bounds.add_argument("--deadline-ms", type=float, help="server-side deadline per request (X-Timeout-Ms)")
    bounds.add_argument(
        "--payloads", type=int, default=16, help="distinct prebuilt request bodies (default %(default)s)"
    )
    bounds.add_argument("--seed", type=int, default=0, help="seed for payloads and arrivals (default %(default)s)")
    bounds.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="raw",
        help="raw: lean keep-alive HTTP/1.1 (default); httpx: httpx.AsyncClient, a cross-check; 40x or more CPU per request",
    )
    checks = parser.add_argument_group("thresholds (exit status 99 when any run breaks one)")
    checks.add_argument("--max-p99-ms", type=float, metavar="MS", help="p99 latency of the ok requests at most MS")
    checks.add_argument("--max-error-rate", type=_share, metavar="RATE", help="failed / sent at most RATE: 0.01 or 1%%")
    output = parser.add_argument_group("output")
    output.add_argument("--json", metavar="FILE", help="write the report as JSON to FILE, or '-' for stdout")
    output.add_argument("--csv", metavar="FILE", help="one CSV row per run to FILE, or '-' for stdout")
    output.add_argument(
        "--plot",
        metavar="FILE.png",
        help="one run: latency over time and histogram; a sweep: throughput against latency",
    )
    output.add_argument("-q", "--quiet", action="store_true", help="no live progress")
    return parser


def _live_progress(console: Console, labels: list[str]) -> tuple[Callable[[int, Progress], None], Any]:
    """A progress callback drawing one updating line with rich, and its Live context."""
    from rich.live import Live
    from rich.text import Text

    live = Live(Text("starting..."), console=console, refresh_per_second=4, transient=True)

    def show(step: int, p: Progress) -> None:
        where = f"step {step + 1}/{len(labels)} {labels[step]} | " if len(labels) > 1 else ""
        phase = "warmup" if p.warming_up else "load"
        live.update(
            Text(
                f"{where}{phase} {p.elapsed_s:5.1f}s sent {p.sent} ok {p.ok} err {p.errors} | "
                f"{p.window_rps:,.0f} req/s p50 {p.window_p50_ms:.1f} p99 {p.window_p99_ms:.1f} ms"
            )
        )

    return show, live


def _problem(message: str, code: int) -> int:
    print(f"ffn-loadtest: error: {message}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    """Console entry point; the exit statuses are in the module's docstring."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.concurrency_range and (args.rate is not None or args.rate_range):
        parser.error("--concurrency-range is a closed-loop sweep: it cannot go with --rate or --rate-range")
    if args.rate is not None and args.rate_range:
        parser.error("--rate and --rate-range: give one")
    if args.concurrency is not None and args.concurrency_range:
        parser.error("--concurrency and --concurrency-range: give one")
    try:
        from rich.console import Console
    except ImportError as exc:
        return _problem(
            f"ffn-loadtest's tables need rich: pip install './client[loadtest]' (from a checkout) ({exc})", EXIT_USAGE
        )
    if args.protocol != "http":
        try:
            import ffn_client.grpc_load  # noqa: F401
        except ImportError as exc:
            return _problem(
                f"--protocol {args.protocol} needs the grpc extra: pip install './client[grpc]' (from a checkout) ({exc})",
                EXIT_USAGE,
            )

    open_loop = args.rate is not None or args.rate_range is not None
    axis, values = ("concurrency", args.concurrency_range) if args.concurrency_range else ("rate", args.rate_range)
    try:
        base = LoadConfig(
            url=args.url or DEFAULT_URLS[args.protocol],
            protocol=args.protocol,
            model=args.model,
            encoding=args.encoding,
            dtype=args.dtype,
            concurrency=args.concurrency
            if args.concurrency is not None
            else DEFAULT_OPEN_LOOP_CONNECTIONS
            if open_loop
            else 8,
            rate=args.rate if args.rate_range is None else args.rate_range[0],
            rows=args.rows,
            duration=args.duration,
            requests=args.requests,
            warmup=args.warmup,
            timeout=args.timeout,
            deadline_ms=args.deadline_ms,
            api_key=args.api_key,
            d_model=args.d_model,
            payloads=args.payloads,
            seed=args.seed,
            engine=args.engine,
            metrics_url=args.metrics_url,
            cacert=args.cacert,
            cert=args.cert,
            key=args.key,
        )
    except ValueError as exc:
        return _problem(str(exc), EXIT_USAGE)
    if values is None:  # one run: a sweep of one step
        axis, values = ("rate", [base.rate]) if base.rate is not None else ("concurrency", [base.concurrency])
    labels = [f"{v:g}/s" if axis == "rate" else f"c={v:g}" for v in values]
    # With JSON or CSV on stdout, everything for people goes to stderr.
    console = Console(stderr="-" in (args.json, args.csv))
    if not console.is_terminal:  # a file or a pipe: as wide as the sweep table needs, not 80 columns
        console = Console(stderr=console.stderr, width=150)
    progress, live = (
        _live_progress(console, labels) if not args.quiet and console.is_terminal else (None, contextlib.nullcontext())
    )
    try:
        with live:
            reports = asyncio.run(run_sweep(base, axis, values, progress))
    except (ConnectionError, LookupError) as exc:
        return _problem(str(exc), EXIT_NOT_MEASURED)
    thresholds = Thresholds(args.max_p99_ms, args.max_error_rate)
    for report in reports:
        report.breaches = thresholds.breaches(report)
    return _output(args, console, reports)


def _output(args: argparse.Namespace, console: Console, reports: list[Report]) -> int:
    """Print the table and notes, write the files asked for, and pick the exit status."""
    from ffn_client.tables import notes, run_table, sweep_table

    sweep = len(reports) > 1
    console.print(sweep_table(reports) if sweep else run_table(reports[0]))
    for style, line in notes(reports):
        console.print(line, style=style, markup=False, highlight=False)
    try:
        if args.json:
            text = _json(reports, sweep)
            if args.json == "-":
                print(text)
            else:
                with open(args.json, "w") as f:
                    f.write(text + "\n")
        if args.csv:
            write_csv(reports, args.csv)
    except OSError as exc:
        return _problem(f"cannot write the report: {type(exc).__name__}: {exc}", EXIT_USAGE)
    if args.plot:
        try:
            from ffn_client.plots import plot_run, plot_sweep

            if sweep:
                plot_sweep(reports, args.plot, args.max_p99_ms)
            else:
                plot_run(reports[0], args.plot)
        except ImportError as exc:
            return _problem(
                f"--plot needs matplotlib: pip install './client[loadtest]' (from a checkout) ({exc})", EXIT_USAGE
            )
        except OSError as exc:
            return _problem(f"cannot write the plot to {args.plot}: {type(exc).__name__}: {exc}", EXIT_USAGE)
        console.print(f"plot written to {args.plot}")
    if not any(r.ok for r in reports):
        return _problem("no request was answered 200 (the errors and their causes are above)", EXIT_NOT_MEASURED)
    if any(r.breaches for r in reports):
        return EXIT_THRESHOLD
    return EXIT_OK


def _json(reports: list[Report], sweep: bool) -> str:
    import json

    if not sweep:
        return reports[0].to_json()
    return json.dumps({"steps": [r.to_dict() for r in reports]}, indent=2)


if __name__ == "__main__":
    raise SystemExit(main())
