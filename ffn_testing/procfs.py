"""A process tree's CPU time and memory, read from Linux's /proc (a server, its workers and engines)."""

from __future__ import annotations

import os
from pathlib import Path

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc's unit of CPU time


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) used so far by process `pid` and all its descendants, children it
    has waited for included (a server and its workers); None where there is no Linux /proc."""
    total, found = 0.0, False
    for current in process_tree(pid):
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            continue
        total += sum(int(ticks) for ticks in fields[11:15]) / CLOCK_TICKS_PER_S  # utime stime cutime cstime
        found = True
    return total if found else None


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, as /proc shows them now (a process that exited meanwhile has none)."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        pending += children(current)
    return found


def read_rss(pid: int) -> int:
    """A process's resident set size in bytes, from /proc/<pid>/status (VmRSS; Linux only)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def read_pss(pid: int) -> int:
    """A process's proportional set size in bytes (Pss, /proc/<pid>/smaps_rollup): each page shared with
    other processes counted as its share, so that a tree's sum is the memory it holds; VmRSS where the
    kernel has no smaps_rollup."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return read_rss(pid)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (none if it has exited)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return []
    found: list[int] = []
    for task in tasks:
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread or the process ended meanwhile
            pass
    return found


def command_line(pid: int) -> bytes:
    """The command line of `pid`, its arguments NUL-separated (empty if it has exited)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:  # exited meanwhile
        return b""
