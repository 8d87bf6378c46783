"""A plot of a bench.transport run: each server's share of the echo's rows/s, and its CPU per request in echoes.

    python -m bench.transport --shared-engine --json docs/bench/transport.json
    python -m bench.transport_plot docs/bench/transport.json docs/img/transport.png

One panel per measure, a group of bars per cell (rows r, clients C), a bar per server the run
measured besides the echo (the echo under ffn-serve's protocol, the service in one process, one
front and the engine). Issue 39's goals are drawn on the cells they are set for: at least 60 % of
the echo's rows/s at r = 16, C = 16 and 75 % at r = 256, C = 16; at most 1.5x the echo's CPU at
r = 1, C = 16, and 2x for the layout.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ECHO = "echo"
SERVER_LABELS = {
    "echo+protocol": "echo under ffn-serve's protocol",
    "near-free": "ffn-serve, one process",
    "near-free+engine": "ffn-serve, a front and the engine",
}
# (rows, clients) -> (server, goal): issue 39's.
SHARE_GOALS = {(16, 16): 0.60, (256, 16): 0.75}
CPU_GOALS = {(1, 16): {"near-free": 1.5, "near-free+engine": 2.0}}


@dataclass(frozen=True)
class Ratio:
    """One server's cell against the echo's in the same run."""

    server: str
    rows: int
    concurrency: int
    share_of_echo: float  # its rows/s over the echo's
    cpu_in_echoes: float  # its CPU per request over the echo's


def ratios(cells: list[dict[str, Any]]) -> list[Ratio]:
    """Every non-echo cell against the echo's cell of the same rows and clients (cells without one are left out)."""
    echoes = {(c["rows"], c["concurrency"]): c for c in cells if c["server"] == ECHO}
    found = []
    for cell in cells:
        echo = echoes.get((cell["rows"], cell["concurrency"]))
        if cell["server"] == ECHO or echo is None:
            continue
        found.append(
            Ratio(
                cell["server"],
                cell["rows"],
                cell["concurrency"],
                cell["rows_per_s"] / echo["rows_per_s"],
                cell["cpu_ms_per_request"] / echo["cpu_ms_per_request"],
            )
        )
    return found


def plot(cells: list[dict[str, Any]], path: Path, title: str) -> None:
    """A PNG at `path`: the two panels, `title` above them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = ratios(cells)
    groups = sorted({(r.rows, r.concurrency) for r in found})
    servers = [s for s in SERVER_LABELS if any(r.server == s for r in found)]
    by_key = {(r.server, r.rows, r.concurrency): r for r in found}
    width = 0.8 / max(1, len(servers))
    fig, (share_axis, cpu_axis) = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    fig.suptitle(textwrap.fill(title, 150), fontsize="small")
    for index, server in enumerate(servers):
        at = [g + (index - (len(servers) - 1) / 2) * width for g in range(len(groups))]
        shares = [by_key[(server, *group)].share_of_echo if (server, *group) in by_key else 0.0 for group in groups]
        cpus = [by_key[(server, *group)].cpu_in_echoes if (server, *group) in by_key else 0.0 for group in groups]
        share_axis.bar(at, shares, width, label=SERVER_LABELS[server])
        cpu_axis.bar(at, cpus, width, label=SERVER_LABELS[server])
        for group_index, group in enumerate(groups):
            goal = CPU_GOALS.get(group, {}).get(server)
            if goal is not None:
                x = at[group_index]
                cpu_axis.plot([x - width / 2, x + width / 2], [goal, goal], color="black", linewidth=2)
    for group_index, group in enumerate(groups):
        goal = SHARE_GOALS.get(group)
        if goal is not None:
            share_axis.plot([group_index - 0.4, group_index + 0.4], [goal, goal], color="black", linewidth=2)
    labels = [f"r={rows}\nC={clients}" for rows, clients in groups]
    share_axis.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    share_axis.set_ylabel("rows/s, share of the echo's")
    share_axis.set_title("throughput against the echo (higher is better; black: issue 39's goal)", fontsize="small")
    cpu_axis.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    cpu_axis.set_ylabel("server CPU per request, in echoes")
    cpu_axis.set_title("CPU per request against the echo (lower is better; black: issue 39's goal)", fontsize="small")
    for axis in (share_axis, cpu_axis):
        axis.set_xticks(range(len(groups)), labels)
        axis.grid(axis="y", alpha=0.3)
        axis.set_ylim(bottom=0)
    share_axis.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a bench.transport --json file")
    p.add_argument("png", type=Path, help="where the plot goes")
    args = p.parse_args(argv)
    run = json.loads(args.run.read_text())
    args.png.parent.mkdir(parents=True, exist_ok=True)
    plot(run["cells"], args.png, run["header"])
    for ratio in ratios(run["cells"]):
        print(
            f"r={ratio.rows:<4} C={ratio.concurrency:<3} {ratio.server:<17} "
            f"{ratio.share_of_echo:6.0%} of the echo's rows/s, {ratio.cpu_in_echoes:4.1f}x its CPU a request"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
