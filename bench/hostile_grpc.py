"""Hostile clients against the gRPC door of a real server: what each flood costs it, and a good caller beside it.

Not run in CI (tests/test_grpc_floods.py runs a short version of each). For each scenario it
starts `python -m app.cli` with an API key on a free 127.0.0.1 port from `--server-dir` (this
checkout by default: point it at another checkout to compare before and after), records the
answer to a 4-row request while quiet, then runs the flood while a good caller makes one
authenticated ModelInfer on a fresh connection every 0.5 s, each answer checked against the quiet
one. It prints a table row per scenario: what the flood got, the server's peak RSS growth, how
many good calls were answered right, and how long until the first good call of the flood was
answered and the slowest took. Scenarios (issue 28, classes 1 to 5):

- preface: 1,100 TCP connections that never send the HTTP/2 preface, held 15 s;
- watch: 1,100 grpc.health.v1 Watch streams (open without a key) over 11 connections, held 15 s;
- headers-only: one connection opening 5,000 ModelInfer streams of HEADERS and nothing else;
- slow-message: 1,100 calls (11 connections) each declaring a 1 MiB message and sending 10 bytes;
- large: 48 concurrent valid 31 MiB ModelInfer calls;
- unread: 400 calls for 128 KiB answers on 4 connections whose flow-control window is 0, held past
  the send timeout (`FFN_SEND_TIMEOUT_S` 2 s here);
- control-message: 20 LogSettings messages of 10 MiB of map entries;
- rapid-reset: streams opened and reset at once on one connection, for 6 s;
- continuation: a header block of 535 CONTINUATION frames of 2,000 tiny fields each (one stream).

    python3 -m bench.hostile_grpc
    python3 -m bench.hostile_grpc --only rapid-reset preface --server-dir /tmp/before

RSS growth is the peak minus the reading before the flood (glibc's mmap threshold fixed, so that
freed memory shows). Timings are noisy on a shared machine; RSS is not.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from bench.hostile_clients import MEASURABLE_MALLOC, MiB, PeakMemory
from bench.hostile_grpc_clients import (
    OWN_CONNECTION,
    GoodCaller,
    callers_beside,
    endless_header_block,
    expected_answer,
    headers_only_streams,
    infer_request,
    never_preface,
    rapid_reset,
    slow_messages,
    unread_answers,
    watch_streams,
)
from ffn_testing import ServerProcess, start_server

REPO_ROOT = Path(__file__).resolve().parents[1]
KEY = "hostile-grpc-key"
D_MODEL = 512
SEND_TIMEOUT_S = 2.0
SCENARIOS = [
    "preface",
    "watch",
    "headers-only",
    "slow-message",
    "large",
    "unread",
    "control-message",
    "rapid-reset",
    "continuation",
]


@dataclass
class Row:
    scenario: str
    outcome: str = ""
    growth_mib: float = 0.0
    good: GoodCaller | None = None
    notes: list[str] = field(default_factory=list)

    def cells(self) -> list[str]:
        good = self.good
        if good is None:
            return [self.scenario, self.outcome, f"+{self.growth_mib:,.0f} MiB", "", "", "; ".join(self.notes)]
        sent = len(good.latencies) + len(good.failures) + good.wrong
        slowest = f"{max(good.latencies):.2f} s" if good.latencies else "none answered"
        if good.failed_at:
            slowest += f"; failing for {good.failing_s:.1f} s"
        failed = sorted({failure.split(";")[0] for failure in good.failures})[:2]
        return [
            self.scenario,
            self.outcome,
            f"+{self.growth_mib:,.0f} MiB",
            f"{len(good.latencies)} of {sent}" + (f" ({good.wrong} wrong)" if good.wrong else ""),
            slowest,
            "; ".join([*self.notes, *failed]),
        ]


HEADER = ["scenario", "what the flood got", "RSS growth", "good calls answered right", "slowest good call", "note"]


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join([*lines, *("| " + " | ".join(row.cells()) + " |" for row in rows)])


async def flooded(server: ServerProcess, scenario: str, flood: Callable[[], Awaitable[str]]) -> Row:
    """`flood` beside a good caller, with the server's peak memory."""
    x = np.random.default_rng(0).standard_normal((4, D_MODEL)).astype(np.float32)
    expected = await expected_answer(server.grpc_target, x, KEY)
    caller = GoodCaller(server.grpc_target, x, expected, KEY)
    async with PeakMemory(server) as memory, callers_beside(caller):
        outcome = await flood()
    return Row(scenario, outcome, memory.growth / MiB, caller)


async def large_calls(target: str, calls: int, mib: int) -> str:
    rows = mib * MiB // (D_MODEL * 4)
    request = infer_request(np.zeros((rows, D_MODEL), np.float32))
    metadata = (("authorization", f"Bearer {KEY}"),)
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1), *OWN_CONNECTION]

    async def one(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> str:
        try:
            await stub.ModelInfer(request, metadata=metadata, timeout=120)
            return "ok"
        except grpc.aio.AioRpcError as error:
            return error.code().name

    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(4)]
    stubs = [service_pb2_grpc.GRPCInferenceServiceStub(channel) for channel in channels]
    outcomes = await asyncio.gather(*(one(stubs[i % 4]) for i in range(calls)))
    for channel in channels:
        await channel.close()
    counts = {outcome: outcomes.count(outcome) for outcome in sorted(set(outcomes))}
    return ", ".join(f"{count} {outcome}" for outcome, count in counts.items())


async def control_messages(target: str, calls: int) -> str:
    request = pb.LogSettingsRequest(
        settings={f"k{i}": pb.LogSettingsRequest.SettingValue(bool_param=True) for i in range(600_000)}
    )
    metadata = (("authorization", f"Bearer {KEY}"),)
    codes = []
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", -1)]) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(calls):
            try:
                await stub.LogSettings(request, metadata=metadata, timeout=120)
                codes.append("OK")
            except grpc.aio.AioRpcError as error:
                codes.append(error.code().name)
    return f"{codes.count('RESOURCE_EXHAUSTED')} of {calls} refused RESOURCE_EXHAUSTED"


async def run(scenario: str, server: ServerProcess) -> Row:
    port = server.grpc_port
    assert port is not None, "the server's gRPC door is off"

    async def preface() -> str:
        closed = await never_preface(port, 1100, 15.0)
        return f"{closed} of 1,100 closed by the server within 15 s"

    async def watch() -> str:
        opened = await watch_streams(server.grpc_target, 1100, 11, 15.0)
        return f"{opened} of 1,100 Watch streams opened"

    async def headers_only() -> str:
        raw = await headers_only_streams(port, 5000, 15.0, KEY)
        return f"{raw.resets} streams reset" + (f", GOAWAY {raw.goaway_code}" if raw.closed else ", connection open")

    async def slow() -> str:
        raws = await asyncio.gather(*(slow_messages(port, 100, 15.0, KEY) for _ in range(11)))
        resets, closed = sum(raw.resets for raw in raws), sum(raw.closed for raw in raws)
        return f"{resets} of 1,100 streams reset, {closed} of 11 connections closed"

    async def unread() -> str:
        x = np.zeros((64, D_MODEL), np.float32)  # 128 KiB answers
        raws = await unread_answers(port, 400, x, SEND_TIMEOUT_S + 8, KEY, connections=4)
        return f"{sum(raw.closed for raw in raws)} of 4 connections ended by the server"

    async def reset() -> str:
        raw = await rapid_reset(port, 6.0, KEY)
        end = f"GOAWAY code {raw.goaway_code}" if raw.goaway_code is not None else ("closed" if raw.closed else "open")
        return f"{raw.resets:,} streams opened and reset; connection {end}"

    async def continuation() -> str:
        raw = await endless_header_block(port, 535)
        return "connection closed" if raw.closed or raw.writer.is_closing() else "connection still open"

    floods: dict[str, Callable[[], Awaitable[str]]] = {
        "preface": preface,
        "watch": watch,
        "headers-only": headers_only,
        "slow-message": slow,
        "large": lambda: large_calls(server.grpc_target, 48, 31),
        "unread": unread,
        "control-message": lambda: control_messages(server.grpc_target, 20),
        "rapid-reset": reset,
        "continuation": continuation,
    }
    return await flooded(server, scenario, floods[scenario])


def server_env() -> dict[str, str]:
    return {
        "FFN_API_KEY": KEY,
        "FFN_WARMUP": "0",
        "FFN_LOG_LEVEL": "warning",
        "FFN_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S),
        **MEASURABLE_MALLOC,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-dir", type=Path, default=REPO_ROOT, help="checkout whose app/ is served")
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, default=SCENARIOS)
    args = parser.parse_args(argv)
    rows = []
    for scenario in args.only:
        with start_server(env=server_env(), cwd=args.server_dir) as server:
            row = asyncio.run(run(scenario, server))
            rows.append(row)
            print("| " + " | ".join(row.cells()) + " |", flush=True)
    print()
    print(f"server: {args.server_dir}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
