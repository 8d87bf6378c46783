"""ffn-loadtest: closed- or open-loop HTTP load against an ffn-serve model, with a latency report.

    ffn-loadtest --requests 2000 --concurrency 16 --rows 1-300 --plot out.png --json -

The generator itself is `ffn_client.load` (`run_load`, `LoadConfig`), usable in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from ffn_client.encodings import DTYPES, ENCODINGS
from ffn_client.load import (
    DEFAULT_DURATION_S,
    DEFAULT_OPEN_LOOP_CONNECTIONS,
    LoadConfig,
    Progress,
    run_load,
)
from ffn_client.report import Report, plot_report, render_table
from ffn_client.senders import ENGINES

if TYPE_CHECKING:  # rich is imported when the CLI runs, not when this module is imported
    from rich.console import Console

__all__ = ["LoadConfig", "Progress", "Report", "build_parser", "main", "run_load"]


def _rows(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    try:
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"rows must be N or LO-HI, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"rows must satisfy 1 <= LO <= HI, got {text!r}")
    return bounds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ffn-loadtest",
        description="Load an ffn-serve model over HTTP and report throughput and latency percentiles.",
    )
    target = parser.add_argument_group("target")
    target.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)")
    target.add_argument("--model", default="demo", help="model name (default %(default)s)")
    target.add_argument("--encoding", choices=ENCODINGS, default="binary", help="wire encoding (default %(default)s)")
    target.add_argument("--dtype", choices=DTYPES, default="float32", help="wire dtype (default %(default)s)")
    target.add_argument("--api-key", default=os.environ.get("FFN_API_KEY"), help="Bearer key (default $FFN_API_KEY)")
    target.add_argument("--d-model", type=int, help="skip asking the server for the model's d_model")
    load = parser.add_argument_group("load")
    load.add_argument("-c", "--concurrency", type=int,
                      help=f"closed loop: concurrent workers (default 8); with --rate: connection pool size (default {DEFAULT_OPEN_LOOP_CONNECTIONS})")
    load.add_argument("-r", "--rate", type=float, help="open loop: Poisson arrivals at this many requests/s")
    load.add_argument("--rows", type=_rows, default=(16, 16), help="rows per request, N or LO-HI uniform (default 16)")
    load.add_argument("-d", "--duration", type=float, help=f"measured seconds (default {DEFAULT_DURATION_S:g} when --requests is not given)")
    load.add_argument("-n", "--requests", type=int, help="measured requests; stops at whichever of --duration and --requests comes first")
    load.add_argument("--warmup", type=float, default=0.0, help="seconds of load before measuring, excluded from the report")
    load.add_argument("--timeout", type=float, default=30.0, help="client-side timeout per request, seconds (default %(default)s)")
    load.add_argument("--deadline-ms", type=float, help="server-side deadline per request (X-Timeout-Ms)")
    load.add_argument("--payloads", type=int, default=16, help="distinct prebuilt request bodies (default %(default)s)")
    load.add_argument("--seed", type=int, default=0, help="seed for payloads and arrivals (default %(default)s)")
    load.add_argument("--engine", choices=sorted(ENGINES), default="raw",
                      help="raw: lean keep-alive HTTP/1.1 (default); httpx: httpx.AsyncClient, a cross-check; 40x or more CPU per request")
    output = parser.add_argument_group("output")
    output.add_argument("--json", metavar="FILE", help="write the report as JSON to FILE, or '-' for stdout")
    output.add_argument("--plot", metavar="FILE.png", help="write latency-over-time and histogram plots")
    output.add_argument("-q", "--quiet", action="store_true", help="no live progress")
    return parser


def _live_progress(console: Console) -> tuple[Callable[[Progress], None], contextlib.AbstractContextManager]:
    """A progress callback drawing one updating line with rich, and its Live context."""
    from rich.live import Live
    from rich.text import Text

    live = Live(Text("starting..."), console=console, refresh_per_second=4, transient=True)

    def show(p: Progress) -> None:
        phase = "warmup" if p.warming_up else "load"
        live.update(Text(
            f"{phase} {p.elapsed_s:5.1f}s sent {p.sent} ok {p.ok} err {p.errors} | "
            f"{p.window_rps:,.0f} req/s p50 {p.window_p50_ms:.1f} p99 {p.window_p99_ms:.1f} ms"
        ))

    return show, live


def main(argv: list[str] | None = None) -> int:
    """Console entry point: 0 when some requests succeeded, 1 when none did or the target failed."""
    args = build_parser().parse_args(argv)
    from rich.console import Console

    concurrency = args.concurrency
    if concurrency is None:
        concurrency = DEFAULT_OPEN_LOOP_CONNECTIONS if args.rate else 8
    try:
        config = LoadConfig(
            url=args.url, model=args.model, encoding=args.encoding, dtype=args.dtype, concurrency=concurrency,
            rate=args.rate, rows=args.rows, duration=args.duration, requests=args.requests, warmup=args.warmup,
            timeout=args.timeout, deadline_ms=args.deadline_ms, api_key=args.api_key, d_model=args.d_model,
            payloads=args.payloads, seed=args.seed, engine=args.engine,
        )
    except ValueError as exc:
        print(f"ffn-loadtest: error: {exc}", file=sys.stderr)
        return 2
    # With the JSON on stdout, everything for people goes to stderr.
    console = Console(stderr=args.json == "-")
    show_progress = not args.quiet and console.is_terminal
    progress, live = _live_progress(console) if show_progress else (None, contextlib.nullcontext())
    try:
        with live:
            report = asyncio.run(run_load(config, progress))
    except (ConnectionError, LookupError) as exc:
        print(f"ffn-loadtest: error: {exc}", file=sys.stderr)
        return 1
    console.print(render_table(report))
    if args.json == "-":
        print(report.to_json())
    elif args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json() + "\n")
    if args.plot:
        plot_report(report, args.plot)
        console.print(f"plot written to {args.plot}")
    return 0 if report.ok > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
