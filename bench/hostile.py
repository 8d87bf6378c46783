"""Hostile clients against a real server: what each kind of abuse costs it, and the good requests beside it.

Not run in CI. It starts `python -m app.cli` on a free 127.0.0.1 port from `--server-dir` (this
checkout by default; point it at another checkout to compare before and after), runs each
scenario on a fresh server, samples the server's VmRSS every 20 ms, and prints one table row each.
Scenarios of issue 11:

- headers: 4 connections each send up to 64 MiB of 8 KB headers of a head that never ends;
- empty-rows: a 64 MiB JSON body of empty rows `[[],[],...]`, while /v2/health/live is probed;
- big-json: a 49 MiB JSON body of valid numbers (10,000 x 513, so refused after parsing: the parse
  alone is measured), while /v2/health/live is probed;
- unread: 12 clients ask for ~10 MiB JSON answers on sockets they never read (and keep open);
  RSS once the answers are computed, and after the send timeout (`--send-timeout`, default 2 s).

Scenarios of issue 20, each beside a stream of good requests (4 clients, each a new connection
per 1-row request; p50 and p99 against the same stream while quiet, measured first in the same run):

- trailers (class 1): chunked requests whose trailer section never ends, 4 at a time, repeated;
- pipelined (class 2): tiny GETs pipelined without reading an answer, 2 connections at a time;
- pipelined-many (class 2): the same on 32 connections at a time;
- pipelining-client (class 2's price): a well-behaved client pipelining 64 GETs ahead of the
  answers it reads, alone and then beside the good requests: its requests/s, in the note;
- trickle (class 5): 64 connections (the cap, FFN_MAX_CONNECTIONS=64) send a body one byte every
  1.5 s, inside a 2 s read timeout, and one refused 503 tries again 0.2 s later; the good
  requests' failures are the 503s;
- reconnect (class 5, as a connection flood): the same tricklers, but one refused tries again at
  once: some 2,500 connections a second, each refused, which is a flood of connections more than
  of slow bodies;
- idle (class 5): 64 connections that say nothing, reopened as the server closes them;
- mc-flood (class 3): 16 clients loop on 64-row x 64-pass Monte Carlo requests (dropout 0.1,
  max_batch_rows 64, a queue of 131,072 row-passes, so that they fill half); the good requests carry X-Timeout-Ms 2000,
  and those answered 504 or later than that are counted past their deadline;
- envelope, strings (class 6): a 57 MiB V2 body of 4.6 M parameter keys, a 25 MiB one of 8.3 M
  empty strings, while /v2/health/live is probed;
- parameters (issue 28 class 6): 2 clients at a time send a 24 MiB V2 body whose input's
  parameters hold an array of 6 M numbers, again as each is answered, beside the good requests;
- held (class 7): 32 clients upload 32 MiB raw bodies at 4 MiB/s each (FFN_MAX_HELD_BYTES 256 MiB),
  each claiming a 1-row shape, so that it is a 400 once read whole: what is measured is the bodies
  held at once, not the compute;
- stopped-worker (class 8): two workers, 8 keep-alive clients, one worker SIGSTOPped: how many
  clients were answered, refused (their connection closed) or left hanging (30 s), and how long
  until a replacement was ready;
- stopped-supervisor (class 8): two workers, the supervisor SIGSTOPped 40 s (as the review paused
  it; `--supervisor-stop-s`): when a POST /v2/logging sent at the stop's start is answered and with what, the good
  requests on new connections meanwhile, and whether the workers are the same ones 15 s after it
  resumes (before: both were killed on resuming).

The server runs with a fixed glibc mmap threshold (MEASURABLE_MALLOC), so that memory it frees
shows in its RSS.

    python3 -m bench.hostile                                  # every scenario, about 10 minutes
    python3 -m bench.hostile --server-dir /tmp/before --only trailers pipelined
    python3 -m bench.hostile --only pipelined --repeat 5 --set FFN_INLINE_FORWARD_US=0   # medians of 5, a setting changed

RSS growth is peak minus the reading before the scenario. Timings are noisy on a shared machine;
RSS is not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.hostile_clients import (
    MEASURABLE_MALLOC,
    V1,
    GoodTraffic,
    MiB,
    PeakMemory,
    Samples,
    empty_rows_body,
    flood_for,
    flood_headers,
    flood_pipelined,
    flood_trailers,
    idle_connection,
    numbers_body,
    one_row_request,
    pipelining_client,
    probe_while,
    quiet_samples,
    slow_upload,
    trickle_body,
    unread_clients,
    unread_request,
)
from ffn_client.http1 import read_response
from ffn_testing import HOST, ServerProcess, http_request, raw_request, start_server

REPO_ROOT = Path(__file__).resolve().parent.parent
QUIET_S = 4.0  # the good requests alone, before each flood
FLOOD_S = 12.0  # how long each repeated flood runs
PIPELINING_MANY = 32  # the pipelined-many scenario's connections at a time
PIPELINED_REQUESTS = 20_000  # the pipelining-client scenario's requests, alone and then beside good ones
REFUSED_TRICKLER_WAIT_S = 0.2  # a trickler refused 503 tries again after this (the reconnect scenario: at once)


@dataclass
class Row:
    """One scenario's figures: what the attack got, the server's memory, and the good requests beside it."""

    scenario: str
    outcome: str
    growth_mib: float | None = None
    quiet: Samples | None = None
    flooded: Samples | None = None
    note: str = ""

    def cells(self) -> list[str]:
        growth = "" if self.growth_mib is None else f"+{self.growth_mib:,.0f} MiB"
        if self.quiet is None or self.flooded is None:
            return [self.scenario, self.outcome, growth, "", "", "", self.note]
        q50, q99 = self.quiet.percentile(50) * 1000, self.quiet.percentile(99) * 1000
        f50, f99 = self.flooded.percentile(50) * 1000, self.flooded.percentile(99) * 1000
        return [
            self.scenario,
            self.outcome,
            growth,
            f"{q50:.1f} / {q99:.1f}",
            f"{f50:.1f} / {f99:.1f} ({f99 / q99:.1f}x)",
            f"{self.flooded.failed} of {len(self.flooded.statuses)}",
            self.note,
        ]


HEADER = [
    "scenario",
    "what the attack got",
    "RSS growth",
    "good p50 / p99 ms, quiet",
    "while flooded",
    "good failed",
    "note",
]


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


async def beside_good_traffic(server: ServerProcess, flood: Callable[[], Awaitable[str]]) -> Row:
    """Quiet good traffic, then the same during `flood` (which names its outcome), with the peak RSS."""
    quiet = await quiet_samples(server.port, QUIET_S)
    async with PeakMemory(server) as memory, GoodTraffic(server.port) as good:
        outcome = await flood()
    return Row("", outcome, memory.growth / MiB, quiet, good.samples)


# ----- issue 11 ------------------------------------------------------------------------------------


async def headers_scenario(server: ServerProcess) -> Row:
    async with PeakMemory(server) as memory:
        await asyncio.wait_for(asyncio.gather(*(flood_headers(server.port, 64 * MiB) for _ in range(4))), 120)
    return Row("headers", "4 x 64 MiB of headers", memory.growth / MiB)


async def body_scenario(server: ServerProcess, name: str, body: bytes, headers: dict[str, str] | None = None) -> Row:
    path = V1 if headers is None else "/v2/models/demo/infer"
    request = http_request("POST", path, {"Content-Type": "application/json"}, body, close=False)
    async with PeakMemory(server) as memory:
        r, waits = await probe_while(server.port, raw_request(server.port, request, timeout=120))
    return Row(
        name,
        f"{len(body) / MiB:.0f} MiB body: {r.status}",
        memory.growth / MiB,
        note=f"{memory.growth / len(body):.1f}x the body; longest probe wait {max(waits, default=0) * 1000:.0f} ms",
    )


async def unread_scenario(server: ServerProcess, send_timeout: float) -> Row:
    request = unread_request()
    assert (await raw_request(server.port, request)).status == 200  # caches at this size, read normally
    before = server.rss_bytes()
    held, after = await unread_clients(server, request, 12, send_timeout)
    return Row(
        "unread",
        "12 clients never reading ~10 MiB answers",
        (after - before) / MiB,
        note=f"+{(held - before) / MiB:.0f} MiB once computed; the growth column is after the send timeout",
    )


# ----- issue 20 ------------------------------------------------------------------------------------


async def trailers_scenario(server: ServerProcess) -> Row:
    async def flood() -> str:
        runs = await flood_for(FLOOD_S, 4, lambda: flood_trailers(server.port, 64 * MiB))
        return f"{runs} trailer floods of up to 64 MiB"

    row = await beside_good_traffic(server, flood)
    row.scenario = "trailers"
    return row


async def pipelined_scenario(server: ServerProcess, connections: int = 2) -> Row:
    async def flood() -> str:
        runs = await flood_for(FLOOD_S, connections, lambda: flood_pipelined(server.port, 64 * MiB))
        return f"{runs} connections pipelining up to 64 MiB of GETs, {connections} at a time"

    return await beside_good_traffic(server, flood)


async def pipelining_client_scenario(server: ServerProcess) -> Row:
    """What pipelined requests taking turns costs a client that pipelines and reads every answer."""
    alone = await pipelining_client(server.port, PIPELINED_REQUESTS)
    rates: list[float] = []

    async def flood() -> str:
        rates.append(await pipelining_client(server.port, PIPELINED_REQUESTS))
        return f"{PIPELINED_REQUESTS:,} GETs pipelined 64 ahead, all answered"

    row = await beside_good_traffic(server, flood)
    row.note = f"the pipelining client: {alone:,.0f} req/s alone, {rates[0]:,.0f} req/s beside the good requests"
    return row


async def trickle_scenario(server: ServerProcess, after_refusal_s: float) -> Row:
    """64 tricklers; one refused 503 tries again after `after_refusal_s` (0: at once, a connection flood)."""

    async def flood() -> str:
        statuses: Counter[str] = Counter()
        loop = asyncio.get_running_loop()
        stop = loop.time() + FLOOD_S

        async def lane() -> None:  # a trickler, and another once it is answered
            while (left := stop - loop.time()) > 1.0:
                status = await trickle_body(server.port, 1.5, limit=left - 0.5)
                statuses["still trickling at the end" if status is None else str(status)] += 1
                if status == 503:
                    await asyncio.sleep(after_refusal_s)

        await asyncio.gather(*(lane() for _ in range(64)))
        return "tricklers: " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))

    return await beside_good_traffic(server, flood)


async def idle_scenario(server: ServerProcess) -> Row:
    async def flood() -> str:
        runs = await flood_for(FLOOD_S, 64, lambda: idle_connection(server.port, FLOOD_S))
        return f"{runs} idle connections, 64 at a time"

    row = await beside_good_traffic(server, flood)
    row.scenario = "idle"
    return row


async def mc_flood_scenario(server: ServerProcess) -> Row:
    deadline_ms = 2000
    x = np.linspace(-1, 1, 64 * 512, dtype="<f4").reshape(64, 512)
    mc = http_request(
        "POST",
        V1 + "?mc_passes=64",
        {"Content-Type": "application/octet-stream", "X-Shape": "64,512"},
        x.tobytes(),
    )
    statuses: Counter[int] = Counter()

    async def mc_client() -> None:
        statuses[(await raw_request(server.port, mc, timeout=120)).status] += 1

    good_request = one_row_request({"X-Timeout-Ms": str(deadline_ms)})
    quiet = await quiet_samples(server.port, QUIET_S, good_request)
    async with GoodTraffic(server.port, request=good_request) as good:
        await flood_for(FLOOD_S, 16, mc_client)
    late = sum(
        status == 504 or (status == 200 and t * 1000 > deadline_ms)
        for t, status in zip(good.samples.latencies, good.samples.statuses, strict=True)
    )
    outcome = "Monte Carlo requests answered " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))
    return Row(
        "mc-flood", outcome, None, quiet, good.samples, f"{late} good requests past their {deadline_ms} ms deadline"
    )


def envelope_body() -> bytes:
    keys = b",".join(b'"k%07d":1' % i for i in range(4_600_000))
    return (
        b'{"parameters": {'
        + keys
        + b'}, "inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": ['
        + b",".join([b"0.5"] * 512)
        + b"]}]}"
    )


def strings_body() -> bytes:
    strings = b",".join([b'""'] * 8_300_000)
    return (
        b'{"parameters": {"s": ['
        + strings
        + b']}, "inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": ['
        + b",".join([b"0.5"] * 512)
        + b"]}]}"
    )


def parameters_body() -> bytes:
    numbers = b",".join([b"1.5"] * 6_000_000)
    return (
        b'{"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "parameters": {"x": ['
        + numbers
        + b']}, "data": ['
        + b",".join([b"0.5"] * 512)
        + b"]}]}"
    )


async def parameters_scenario(server: ServerProcess) -> Row:
    body = parameters_body()
    request = http_request("POST", "/v2/models/demo/infer", {"Content-Type": "application/json"}, body)
    statuses: Counter[int | None] = Counter()

    async def send() -> None:
        statuses[(await raw_request(server.port, request, timeout=120)).status] += 1

    async def flood() -> str:
        await flood_for(FLOOD_S, 2, send)
        answered = ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items(), key=str))
        return f"{sum(statuses.values())} bodies of {len(body) / MiB:.0f} MiB answered {answered}"

    row = await beside_good_traffic(server, flood)
    row.note = f"longest good request {max(row.flooded.latencies, default=0) * 1000:,.0f} ms" if row.flooded else ""
    return row


async def held_scenario(server: ServerProcess) -> Row:
    statuses: Counter[int | None] = Counter()

    async def upload() -> None:
        statuses[await slow_upload(server.port, 32 * MiB, 4 * MiB, shape="1,512")] += 1

    async with PeakMemory(server) as memory:
        await asyncio.gather(*(upload() for _ in range(32)))
    outcome = "32 x 32 MiB uploads answered " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items(), key=str))
    return Row("held", outcome, memory.growth / MiB)


async def stopped_worker_scenario(server: ServerProcess) -> Row:
    # The port answers once one worker is ready; one still loading has a longer bound: stop a ready one.
    async with asyncio.timeout(120):
        while "ready: 2 workers" not in server.logs():
            await asyncio.sleep(0.1)
    request = one_row_request()
    connections = [await asyncio.open_connection(HOST, server.port) for _ in range(8)]

    async def ask(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> str:
        reader, writer = connection
        try:
            writer.write(request.replace(b"Connection: close\r\n", b""))
            await writer.drain()
            return "answered" if (await asyncio.wait_for(read_response(reader), 30)).status == 200 else "refused"
        except TimeoutError:
            return "hanging"
        except (OSError, asyncio.IncompleteReadError, ConnectionError):
            return "refused"

    assert set(await asyncio.gather(*(ask(c) for c in connections))) == {"answered"}
    victim = min(server.worker_pids())
    loop = asyncio.get_running_loop()
    stopped = loop.time()
    os.kill(victim, signal.SIGSTOP)
    try:
        outcomes = Counter(await asyncio.gather(*(ask(c) for c in connections)))
        replaced = None
        while loop.time() - stopped < 60:
            logs = server.logs()
            after = logs.partition(f"(pid {victim}) was killed by SIGKILL")[2]
            if re.search(r"worker \d \(pid \d+\) ready", after):
                replaced = loop.time() - stopped
                break
            await asyncio.sleep(0.1)
    finally:
        try:
            os.kill(victim, signal.SIGCONT)
        except ProcessLookupError:
            pass
        for _, writer in connections:
            writer.close()
    note = "never replaced (60 s)" if replaced is None else f"a replacement ready {replaced:.1f} s after the stop"
    return Row("stopped-worker", ", ".join(f"{k}: {v}" for k, v in sorted(outcomes.items())), note=note)


STOPPED_SUPERVISOR_S = 40.0  # the review's pause (--supervisor-stop-s)
AFTER_RESUMING_S = 15.0  # then this long to see whether a worker is replaced (2 x heartbeat_timeout_s and more)


async def stopped_supervisor_scenario(server: ServerProcess, stop_s: float) -> Row:
    async with asyncio.timeout(120):
        while "ready: 2 workers" not in server.logs():
            await asyncio.sleep(0.1)
    workers = server.worker_pids()
    log_setting = http_request(
        "POST", "/v2/logging", {"Content-Type": "application/json"}, b'{"log_verbose_level": 0}', close=True
    )
    good = one_row_request()
    loop = asyncio.get_running_loop()
    answered: list[str] = []

    async def change_the_log_setting(stopped: float) -> None:
        try:
            r = await raw_request(server.port, log_setting, timeout=stop_s + 30)
            when = loop.time() - stopped
            answered.append(f"{r.status} after {when:.1f} s" + (" (once resumed)" if when > stop_s else ""))
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            answered.append(f"no answer ({type(exc).__name__})")

    statuses: Counter[int | None] = Counter()
    first_failed: float | None = None
    stopped = loop.time()
    os.kill(server.pid, signal.SIGSTOP)
    try:
        change = asyncio.create_task(change_the_log_setting(stopped))
        while loop.time() - stopped < stop_s:
            try:
                status: int | None = (await raw_request(server.port, good, timeout=5)).status
            except (TimeoutError, OSError, asyncio.IncompleteReadError):
                status = None
            statuses[status] += 1
            if status != 200 and first_failed is None:
                first_failed = loop.time() - stopped
    finally:
        os.kill(server.pid, signal.SIGCONT)
    await change
    await asyncio.sleep(AFTER_RESUMING_S)
    now = server.worker_pids()
    outcome = f"POST /v2/logging: {answered[0]}; good requests while stopped: " + ", ".join(
        f"{k}: {v}" for k, v in sorted(statuses.items(), key=str)
    )
    if first_failed is not None:
        outcome += f" (the first failed {first_failed:.0f} s into the stop)"
    note = f"workers replaced {AFTER_RESUMING_S:g} s after resuming: {len(workers - now)} of {len(workers)}"
    return Row("stopped-supervisor", outcome, note=note)


# ----- running them ---------------------------------------------------------------------------------

SCENARIOS = [
    "headers",
    "empty-rows",
    "big-json",
    "unread",
    "trailers",
    "pipelined",
    "pipelined-many",
    "pipelining-client",
    "trickle",
    "reconnect",
    "idle",
    "mc-flood",
    "envelope",
    "strings",
    "parameters",
    "held",
    "stopped-worker",
    "stopped-supervisor",
]


def server_env(scenario: str, send_timeout: float) -> dict[str, str]:
    env = {"FFN_WARMUP": "0", "FFN_LOG_LEVEL": "warning", "FFN_SEND_TIMEOUT_S": str(send_timeout), **MEASURABLE_MALLOC}
    if scenario in ("trickle", "reconnect", "idle"):
        env |= {"FFN_MAX_CONNECTIONS": "64", "FFN_READ_TIMEOUT_S": "2"}
    if scenario == "mc-flood":
        env |= {"FFN_MAX_BATCH_ROWS": "64", "FFN_MAX_QUEUE_ROWS": "131072", "FFN_MAX_MC_PASSES": "64"}
    if scenario == "held":
        env |= {"FFN_MAX_HELD_BYTES": str(256 * MiB)}
    if scenario in ("stopped-worker", "stopped-supervisor"):
        env |= {"FFN_WORKERS": "2", "FFN_LOG_LEVEL": "info"}
    return env


async def run(scenario: str, server: ServerProcess, send_timeout: float, supervisor_stop_s: float) -> Row:
    scenarios: dict[str, Callable[[], Awaitable[Row]]] = {
        "headers": lambda: headers_scenario(server),
        "empty-rows": lambda: body_scenario(server, scenario, empty_rows_body(64 * MiB)),
        "big-json": lambda: body_scenario(server, scenario, numbers_body(10_000, 513)),
        "unread": lambda: unread_scenario(server, send_timeout),
        "trailers": lambda: trailers_scenario(server),
        "pipelined": lambda: pipelined_scenario(server),
        "pipelined-many": lambda: pipelined_scenario(server, PIPELINING_MANY),
        "pipelining-client": lambda: pipelining_client_scenario(server),
        "trickle": lambda: trickle_scenario(server, REFUSED_TRICKLER_WAIT_S),
        "reconnect": lambda: trickle_scenario(server, 0.0),
        "idle": lambda: idle_scenario(server),
        "mc-flood": lambda: mc_flood_scenario(server),
        "envelope": lambda: body_scenario(server, scenario, envelope_body(), {}),
        "strings": lambda: body_scenario(server, scenario, strings_body(), {}),
        "parameters": lambda: parameters_scenario(server),
        "held": lambda: held_scenario(server),
        "stopped-worker": lambda: stopped_worker_scenario(server),
        "stopped-supervisor": lambda: stopped_supervisor_scenario(server, supervisor_stop_s),
    }
    return await scenarios[scenario]()


def server_overrides(pairs: list[str]) -> dict[str, str]:
    """--set FFN_X=1 ... as a dict; a pair without '=' or a name outside FFN_ is refused."""
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.startswith("FFN_"):
            raise SystemExit(f"--set {pair!r}: give FFN_NAME=value")
        env[name] = value
    return env


def ratio_summary(rows: list[Row]) -> str:
    """Per scenario with good traffic: the flooded p99 over the quiet one, each run's and their median."""
    by: dict[str, list[float]] = {}
    for row in rows:
        if row.quiet is not None and row.flooded is not None:
            by.setdefault(row.scenario, []).append(row.flooded.percentile(99) / row.quiet.percentile(99))
    lines = ["| scenario | runs | flooded p99 / quiet p99, median | each run |", "|---|---:|---:|---|"]
    for scenario, ratios in by.items():
        each = ", ".join(f"{r:.1f}x" for r in ratios)
        lines.append(f"| {scenario} | {len(ratios)} | {statistics.median(ratios):.2f}x | {each} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-dir", type=Path, default=REPO_ROOT, help="checkout whose app/ is served")
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, default=SCENARIOS)
    parser.add_argument("--send-timeout", type=float, default=2.0, help="FFN_SEND_TIMEOUT_S of the server")
    parser.add_argument(
        "--set", action="append", default=[], metavar="FFN_NAME=VALUE", help="a server setting for every scenario"
    )
    parser.add_argument(
        "--supervisor-stop-s", type=float, default=STOPPED_SUPERVISOR_S, help="how long stopped-supervisor stops it"
    )
    parser.add_argument("--repeat", type=int, default=1, help="run the scenarios this many times, in turn")
    args = parser.parse_args(argv)
    overrides = server_overrides(args.set)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "ffn.toml"
        config.write_text('[[models]]\nname = "demo"\ndropout = 0.1\n')  # the built-in demo, with a dropout rate
        for _ in range(args.repeat):
            for scenario in args.only:
                with start_server(
                    env=server_env(scenario, args.send_timeout) | overrides,
                    config=config if scenario == "mc-flood" else None,
                    cwd=args.server_dir,
                ) as server:
                    row = asyncio.run(run(scenario, server, args.send_timeout, args.supervisor_stop_s))
                    row.scenario = scenario
                    rows.append(row)
                    print("| " + " | ".join(row.cells()) + " |", flush=True)
    print()
    print(f"server: {args.server_dir}" + "".join(f" {k}={v}" for k, v in overrides.items()))
    print(table(rows))
    if args.repeat > 1:
        print()
        print(ratio_summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
