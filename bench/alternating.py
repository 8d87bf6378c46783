"""This checkout against another, both serving at once, loaded in alternating order: an A/B of small effects.

    git worktree add ../before <commit>
    python -m bench.alternating --against ../before                               # near-free, r=1 C=16
    python -m bench.alternating --against ../before --rows 1 16 256 --concurrency 1 16 --rounds 6
    python -m bench.alternating --against ../before --shared-engine --rows 1 256  # one front and the engine each
    python -m bench.alternating --against ../before --d-ff 3072 --concurrency 16 64  # the real model
    python -m bench.alternating --against .                                       # an A/A run: the method's own bias

bench.transport starts each server for its cell in turn: on this shared 2-core machine the host's
speed drifts by more than a few percent between two servers' turns, which hides a change of that
size. Here both servers serve at once, pinned to the same server core (the idle one costs
nothing), and each round loads one then the other, the order swapped every round, so that a
drift hits both alike. The server started first came out several percent slower than the
second in an A/A run (one checkout against itself) on this machine, whichever it was: so the
rounds run in two halves, the servers started in one order for the first half and in the other
for the second (restarted between). The table gives each side's median rows/s and server CPU
per request (its process tree, from /proc) and their ratio. Run the same checkout against
itself first (`--against .`): what that shows is the method's own spread at that hour.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import transport
from bench.gpu import service
from ffn_core import FFNConfig, build_ffn, save_ffn
from ffn_testing import ServerProcess

SIDES = ("this", "other")


@dataclass(frozen=True)
class Round:
    """One side's load of one cell in one round."""

    side: str  # "this" or "other"
    rows: int
    concurrency: int
    rows_per_s: float
    cpu_us_per_request: float
    errors: int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", type=Path, required=True, help="the other checkout (`.`: this one, an A/A run)")
    p.add_argument("--rows", type=int, nargs="+", default=[1])
    p.add_argument("--concurrency", type=int, nargs="+", default=[16])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seconds", type=float, default=3.0, help="per side, cell and round")
    p.add_argument("--d-ff", type=int, default=8, help="8: the near-free model; 3072: the real one (768/3072, GELU)")
    p.add_argument("--shared-engine", action="store_true", help="each side as one front and one engine process")
    return p.parse_args(argv)


def table(rounds: list[Round]) -> str:
    """Medians per cell and side, and this side's over the other's."""
    lines = [
        "| r | C | this: rows/s | other: rows/s | rows/s, this ÷ other | this: CPU µs/req | other: CPU µs/req "
        "| CPU, this ÷ other | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cells = sorted({(r.rows, r.concurrency) for r in rounds})
    for rows, concurrency in cells:
        of = {
            side: [r for r in rounds if (r.rows, r.concurrency, r.side) == (rows, concurrency, side)] for side in SIDES
        }
        rate = {side: statistics.median(r.rows_per_s for r in of[side]) for side in SIDES}
        cpu = {side: statistics.median(r.cpu_us_per_request for r in of[side]) for side in SIDES}
        errors = sum(r.errors for side in SIDES for r in of[side])
        lines.append(
            f"| {rows} | {concurrency} | {rate['this']:,.0f} | {rate['other']:,.0f} | {rate['this'] / rate['other']:.3f} "
            f"| {cpu['this']:.1f} | {cpu['other']:.1f} | {cpu['this'] / cpu['other']:.3f} | {errors} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    defaults = transport.parse_args([])
    server_cores = transport.cores(defaults.server_cpus)
    rounds: list[Round] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        torch.manual_seed(0)
        model = build_ffn(FFNConfig(transport.D_MODEL, args.d_ff, "gelu")).requires_grad_(False)
        save_ffn(model, folder / "model.safetensors")
        config = folder / "model.toml"
        config.write_text(f'[[models]]\nname = "{service.MODEL}"\nweights = "model.safetensors"\n')
        configs = {"near-free": config}
        checkouts = dict(zip(SIDES, (transport.REPO_ROOT, args.against.resolve()), strict=True))
        for half, first in enumerate((0, args.rounds // 2)):
            with contextlib.ExitStack() as started:
                servers: dict[str, ServerProcess] = {}
                for side in SIDES if half == 0 else SIDES[::-1]:  # the first started, then the other first
                    server = transport.Server(side, "near-free", checkouts[side], shared_engine=args.shared_engine)
                    servers[side] = started.enter_context(transport.running(server, configs, server_cores))
                rounds += measure(servers, args, folder, range(first, args.rounds if half else args.rounds // 2))
    layout = "one front and the engine" if args.shared_engine else "one process"
    print()
    print(
        f"this checkout against {args.against}: d_model {transport.D_MODEL}, d_ff {args.d_ff}, {layout} each, "
        f"both on cores {defaults.server_cpus}, load on {defaults.client_cpus}; {args.rounds} rounds of "
        f"{args.seconds:g} s, alternating, in two halves started in either order; medians"
    )
    print()
    print(table(rounds))
    return 0


def measure(servers: dict[str, ServerProcess], args: argparse.Namespace, folder: Path, numbers: range) -> list[Round]:
    """Rounds `numbers` of every cell against both servers, the order swapped every round."""
    defaults = transport.parse_args([])
    client_cores = transport.cores(defaults.client_cpus)
    rounds: list[Round] = []
    for rows in args.rows:
        body, headers, _ = service.prepared_body(rows, transport.D_MODEL, folder)
        for concurrency in args.concurrency:
            load = functools.partial(
                service.load,
                defaults.generator,
                body=body,
                headers=headers,
                rows=rows,
                d_model=transport.D_MODEL,
                concurrency=concurrency,
                cores=client_cores,
            )
            for process in servers.values():  # warm-up, untimed
                load(url=process.url, seconds=1.0)
            for number in numbers:
                for side in SIDES if number % 2 == 0 else SIDES[::-1]:
                    process = servers[side]
                    before = service.tree_cpu_seconds(process.pid)
                    result = load(url=process.url, seconds=args.seconds)
                    cpu = service.tree_cpu_seconds(process.pid) - before
                    found = Round(
                        side,
                        rows,
                        concurrency,
                        result.requests * rows / result.seconds,
                        1e6 * cpu / max(result.requests, 1),
                        result.errors,
                    )
                    rounds.append(found)
                    print(
                        f"round {number + 1}/{args.rounds} {side:5s} r={rows} C={concurrency}: "
                        f"{found.rows_per_s:,.0f} rows/s, {found.cpu_us_per_request:.1f} µs CPU/req",
                        flush=True,
                    )
    return rounds


if __name__ == "__main__":
    sys.exit(main())
