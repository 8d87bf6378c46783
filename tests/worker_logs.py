"""Reading a multi-worker server's JSON log: which worker process served what, and when a worker was replaced.

For tests that start `ffn-serve` with FFN_WORKERS > 1, FFN_LOG_FORMAT=json and FFN_ACCESS_LOG=true:
each worker's record carries its pid; the supervisor's lines say which pid each worker slot holds.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

from ffn_testing import ServerProcess


def records(server: ServerProcess, since: int = 0) -> list[dict]:
    """The server's JSON log records from character `since` on (a partial last line is left out)."""
    found = []
    for line in server.logs()[since:].splitlines():
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return found


def pids_that_served(server: ServerProcess, path: str, since: int) -> set[int]:
    """The pids of the workers whose access log shows `path` served, from character `since` of the log."""
    return {r["pid"] for r in records(server, since) if r["logger"] == "uvicorn.access" and r.get("path") == path}


def worker_pids(server: ServerProcess) -> dict[int, int]:
    """Worker number -> the pid of the latest process the supervisor started in that slot."""
    pids: dict[int, int] = {}
    for record in records(server):
        match = re.fullmatch(r"worker (\d+) started \(pid (\d+)\)", record["message"])
        if match:
            pids[int(match[1])] = int(match[2])
    return pids


def until(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    """Wait, polling, for `condition()`; a bounded wait that fails naming `what`."""
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, f"timed out waiting for {what}"
        time.sleep(0.1)


def replaced(server: ServerProcess, slot: int, old_pid: int, since: int) -> int:
    """Wait for the supervisor to replace worker `slot` (was `old_pid`) and the new one to be ready; its pid."""
    until(lambda: worker_pids(server)[slot] != old_pid, f"a replacement for worker {slot}")
    pid = worker_pids(server)[slot]
    until(
        lambda: any(r["message"] == f"worker {slot} (pid {pid}) ready" for r in records(server, since)),
        f"worker {slot}'s replacement to be ready",
    )
    return pid
